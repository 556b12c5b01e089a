"""Reclaim and in-flight holders in the randomised trials (issue 8 §5).

Importing this module registers, beside ``tests/trials.py``'s actions:

- ``reclaim``: ``gpuctl reclaim --json``, its output kept with its start and end times;
- ``request``: a process that holds ``gpuctl.api.in_use`` around ``ensure_ready`` and a
  streamed chat request, and says whether the request ran to its end;
- ``touch`` again, timed (its spawn time is a lower bound of when it touched);

and two invariants, checked after each trial:

- **no service is stopped while a request was in flight**: a request that was cut, with
  no ``gpuctl stop`` of its service under way (a person may stop a server on purpose),
  is a violation;
- **no service is stopped within its idle timeout of a touch**: a reclaim that started
  after a touch ended must not stop the service unless more than its idle timeout had
  passed since the touch began, by the end of that reclaim.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field

from tests.conftest import gpuctl_exe
from tests.ensure_helpers import cli_env
from tests.trials import ACTIONS, RESETS, Caller, Svc, Trial, action, preempts
from tests.trials import check as end_check

IDLE_TIMEOUT_S = 2.0  # what tests/trials.py configures, so reclaim has work to do


@dataclass
class Timed:
    service: str
    started: float
    ended: float | None = None
    out: str = ""
    proc: subprocess.Popen[str] | None = None


@dataclass
class Log:
    reclaims: list[Timed] = field(default_factory=list)
    requests: list[Timed] = field(default_factory=list)
    touches: list[Timed] = field(default_factory=list)
    stops: list[Timed] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_logs: dict[int, Log] = {}


def log_of(t: Trial) -> Log:
    return _logs.setdefault(id(t), Log())


def _follow(entry: Timed, proc: subprocess.Popen[str]) -> None:
    """Note when ``proc`` ends, and what it printed (a thread per caller)."""

    def wait() -> None:
        out, _ = proc.communicate()
        entry.ended = time.time()
        entry.out = out or ""

    threading.Thread(target=wait, daemon=True).start()


def _spawn(t: Trial, label: str, s: Svc, argv: list[str]) -> tuple[Timed, subprocess.Popen[str]]:
    entry = Timed(s.name, time.time())
    proc = subprocess.Popen(
        argv, env=cli_env(t.cfg), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    entry.proc = proc
    t.callers.append(Caller(label, s.name, proc))
    _follow(entry, proc)
    return entry, proc


@action("reclaim", 2)
def _reclaim(t: Trial, s: Svc) -> None:
    """``gpuctl reclaim --json``, often a while later (as cron would come by), so that
    services have sat idle past their timeout: the process sleeps, then becomes reclaim
    (``exec``: a ``kill -9`` of it is a kill of reclaim)."""
    delay = t.rng.choice([0.0, t.rng.uniform(1.0, 4.0)])
    later = f"import os, time; time.sleep({delay}); os.execv({gpuctl_exe()!r}, {[gpuctl_exe(), 'reclaim', '--json']!r})"
    entry, _ = _spawn(t, "reclaim", s, [sys.executable, "-c", later])
    entry.started += delay  # it reads nothing before then: a lower bound of its start
    with log_of(t).lock:
        log_of(t).reclaims.append(entry)


_REQUEST = textwrap.dedent(
    """
    import json, sys, time
    import httpx
    from gpuctl.api import ensure_ready_sync, in_use
    svc, cfg, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = {"result": "not-ready"}
    with in_use(svc, config=cfg):
        r = ensure_ready_sync(svc, config=cfg, timeout=20)
        if r.ready:
            out["t_req"] = time.time()
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 25,
                    "stream": True}
            finish = None
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                                  json=body, timeout=30) as resp:
                    if resp.status_code != 200:
                        finish = f"HTTP {resp.status_code}"
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            for c in json.loads(line[6:])["choices"]:
                                finish = c.get("finish_reason") or finish
            except httpx.HTTPError as e:
                finish = f"{type(e).__name__}: {e}"
            out["result"] = "ok" if finish == "length" else f"cut ({finish})"
    out["t_end"] = time.time()
    print(json.dumps(out), flush=True)
    """
)


@action("request (in_use)", 2)
def _request(t: Trial, s: Svc) -> None:
    argv = [sys.executable, "-c", _REQUEST, s.name, str(t.cfg), str(s.port)]
    entry, _ = _spawn(t, "request", s, argv)
    t.callers[-1].preempts = preempts(s)  # its ensure_ready preempts for chat
    with log_of(t).lock:
        log_of(t).requests.append(entry)


def _timed(name: str, kind: str) -> None:
    """Wrap a registered action so each of its callers' spawn and end times are kept."""
    weight, fn = ACTIONS[name]

    def wrapped(t: Trial, s: Svc) -> None:
        start = time.time()
        before = len(t.callers)
        fn(t, s)
        for c in t.callers[before:]:
            entry = Timed(c.service, start)
            watcher = threading.Thread(target=_end_of, args=(entry, c.proc), daemon=True)
            watcher.start()
            with log_of(t).lock:
                getattr(log_of(t), kind).append(entry)

    ACTIONS[name] = (weight, wrapped)


def _end_of(entry: Timed, proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(Exception):
        proc.wait()
    entry.ended = time.time()


_timed("touch", "touches")
_timed("stop", "stops")


def _stopped_by(reclaim: Timed) -> set[str]:
    """The services a reclaim run stopped (from its JSON; none when it was killed)."""
    try:
        out = json.loads(reclaim.out)
    except ValueError:
        return set()
    return {
        c["service"]
        for c in out.get("candidates", [])
        if c.get("done") and c.get("action") in ("stop", "sleep", "unload")
    }


@end_check
def check(t: Trial) -> None:
    log = log_of(t)
    for r in log.requests:
        try:
            out = json.loads(r.out.strip().splitlines()[-1]) if r.out.strip() else {}
        except ValueError:
            out = {}
        result = str(out.get("result", ""))
        t.checked["no request cut in flight"] += 1
        if not result.startswith("cut"):
            continue  # ran to its end, never got to ask, or was killed (no output)
        end = float(out.get("t_end") or time.time())
        manual = [x for x in log.stops if x.service == r.service and x.started <= end]
        if not manual:
            t.violations.append(
                f"a request to {r.service} was cut while in flight ({result}), and no "
                "gpuctl stop of it was under way"
            )
    for rc in log.reclaims:
        if rc.ended is None:
            continue
        for svc in _stopped_by(rc):
            t.checked["no reclaim stop within the idle timeout of a touch"] += 1
            for touch in log.touches:
                if (
                    touch.service == svc
                    and touch.ended is not None
                    and touch.ended < rc.started
                    and rc.ended - touch.started <= IDLE_TIMEOUT_S
                ):
                    t.violations.append(
                        f"reclaim stopped {svc} {rc.ended - touch.started:.2f}s after a touch "
                        f"(idle timeout {IDLE_TIMEOUT_S:g}s)"
                    )


def reset(t: Trial) -> None:
    _logs.pop(id(t), None)


RESETS.append(reset)
