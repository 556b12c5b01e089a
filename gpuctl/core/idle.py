"""Idle selection for ``gpuctl reclaim``: which services to stop, and why.

``judge`` is a pure function of one service's facts (its spec, its record, what is in
flight) and the clock. A managed service is stopped only when every one of these holds:

- it runs (its record says ``running``), and gpuctl started it: the record names its
  server (an Ollama model needs none: the daemon is shared, and unloading a model
  stops no process);
- its ``idle_timeout`` is not ``"never"``, and ``last_used`` is older than it;
- no lease is held on it (no start, stop or wake under way);
- no request is in flight: the server's own count (vLLM's running + waiting) and the
  store's in-flight entries (``gpuctl.api.in_use``, the proxy) are both 0, and no
  lingering entry stands (a proxy that may send the next request without counting it
  first: ``core.record.LINGER_ENTRY``).

A service past its timeout with requests in flight is in use: reclaim touches it. One
whose in-flight requests cannot be read is kept (never stop blind), and so is a
``process``-launched server on another machine, which only that machine can signal.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from gpuctl.core.record import Phase
from gpuctl.core.units import format_duration


class Action(StrEnum):
    STOP = "stop"  # the launcher's stop (container, process group, terminal)
    SLEEP = "sleep"  # vLLM sleep mode
    UNLOAD = "unload"  # Ollama's keep_alive 0
    TOUCH = "touch"  # busy past its timeout: in use
    KEEP = "keep"  # nothing to do (or not allowed to)

    @property
    def frees(self) -> bool:
        return self in (Action.STOP, Action.SLEEP, Action.UNLOAD)


class IdleFacts(msgspec.Struct, frozen=True):
    """What reclaim knows about one service on one host.

    ``server_in_flight`` is None where the server has no such metric (Ollama) or it was
    not read (the service is not past its timeout); ``in_flight_error`` says why it could
    not be read when it should have been.
    """

    service: str
    managed: bool  # it has a launcher: gpuctl starts it
    idle_timeout_s: float | None  # None: "never"
    stop: str = "stop"  # "stop" | "sleep"
    launcher: str | None = None
    sleep_level: int | None = None
    phase: Phase = Phase.STOPPED
    last_used: float | None = None
    since: float = 0.0
    lease: str | None = None  # who holds the lease, in words; None: nobody
    has_handle: bool = False
    store_in_flight: int = 0
    # Seconds until the service's last lingering in-flight entry lapses (0: none).
    store_lingering_s: float = 0.0
    server_in_flight: int | None = None
    in_flight_error: str | None = None
    remote_process: str | None = None  # the machine a process-launched server runs on


class Candidate(msgspec.Struct, frozen=True):
    """What reclaim does about one service, and why (``quiet``: not worth a line)."""

    service: str
    action: Action
    reason: str
    idle_s: float | None = None
    quiet: bool = True


def short_duration(seconds: float) -> str:
    """``2460`` → ``41m``; ``64`` → ``1m04s``; ``60`` → ``1m``; ``3900`` → ``1h05m``.

    The shared formatter's form, with the seconds kept under 10 minutes (``idle 1m > 1m``
    read as a contradiction) and dropped where they are zero or too small to matter.
    """
    s = max(0, int(seconds))
    if s < 600:
        text = format_duration(s)
        return text[:-3] if text.endswith("m00s") else text
    if s < 3600:
        return f"{s // 60}m"
    return format_duration(s)


def versus(idle: float, limit: float, sign: str) -> str:
    """``41m > 30m``: an idle time against its limit, never reading as a contradiction.

    Two times that round to the same text (``2s > 2s``) are shown to a tenth of a
    second when short (``2.3s > 2.0s``), else compared with ``≥`` or ``≤`` (``30m ≥
    30m``), which the rounded texts make true.
    """
    a, b = short_duration(idle), short_duration(limit)
    if a != b:
        return f"{a} {sign} {b}"
    a, b = f"{idle:.1f}s", f"{limit:.1f}s"
    if a != b and max(idle, limit) < 60:
        return f"{a} {sign} {b}"
    return f"{short_duration(idle)} {'≥' if sign == '>' else '≤'} {short_duration(limit)}"


def idle_for(f: IdleFacts, now: float) -> float:
    """Seconds since it was last used (since its phase began, if it never was)."""
    ref = f.last_used if f.last_used is not None else f.since
    return max(0.0, now - ref)


def past_timeout(f: IdleFacts, now: float) -> bool:
    """Whether it has sat unused past its idle timeout (never for ``"never"``)."""
    return f.idle_timeout_s is not None and idle_for(f, now) > f.idle_timeout_s


def free_action(f: IdleFacts) -> Action:
    """How this service's memory is freed: its ``stop`` setting, and Ollama's unload."""
    if f.launcher == "ollama":
        return Action.UNLOAD
    return Action.SLEEP if f.stop == "sleep" else Action.STOP


def needs_lingering(f: IdleFacts, now: float) -> bool:
    """Whether the store's lingering entries must be read before judging (only for a
    running managed service past its timeout, with no lease), whatever its launcher."""
    return f.managed and f.phase is Phase.RUNNING and f.lease is None and past_timeout(f, now)


def needs_in_flight(f: IdleFacts, now: float) -> bool:
    """Whether the server's in-flight requests must be read before judging (as
    ``needs_lingering``: one read per candidate)."""
    return (
        needs_lingering(f, now)
        and f.launcher != "ollama"  # Ollama has no such metric: the store's counts alone
    )


def judge(f: IdleFacts, now: float) -> Candidate:
    """The action for one service (see the module docstring for the rules, in order)."""
    name = f.service
    if not f.managed:
        return Candidate(name, Action.KEEP, "not managed by gpuctl (no launcher)")
    if f.phase is Phase.SLEEPING:
        return Candidate(name, Action.KEEP, "asleep (vLLM sleep mode)")
    if f.phase is Phase.STARTING:
        return Candidate(name, Action.KEEP, "starting")
    if f.phase is not Phase.RUNNING:
        return Candidate(name, Action.KEEP, f"not running ({f.phase.value})")
    if f.idle_timeout_s is None:
        return Candidate(name, Action.KEEP, 'idle_timeout = "never"')
    idle = idle_for(f, now)
    if not past_timeout(f, now):
        return Candidate(name, Action.KEEP, "idle " + versus(idle, f.idle_timeout_s, "<"), idle)
    # Past its timeout: from here on every outcome is worth a line.
    if f.lease is not None:
        return Candidate(name, Action.KEEP, f"lease held by {f.lease}", idle, quiet=False)
    in_flight = f.store_in_flight + (f.server_in_flight or 0)
    if in_flight > 0:
        what = "request" if in_flight == 1 else "requests"
        return Candidate(name, Action.TOUCH, f"in flight: {in_flight} {what}", idle, quiet=False)
    if f.store_lingering_s > 0:
        return Candidate(
            name,
            Action.KEEP,
            f"a proxy may send it a request for {f.store_lingering_s:.0f}s more "
            "(its lingering in-flight entry)",
            idle,
            quiet=False,
        )
    if f.in_flight_error is not None:
        return Candidate(
            name,
            Action.KEEP,
            f"cannot tell whether requests are in flight ({f.in_flight_error})",
            idle,
            quiet=False,
        )
    if f.remote_process is not None:
        return Candidate(
            name,
            Action.KEEP,
            f"a process on {f.remote_process}: only that machine can stop it "
            "(run gpuctl reclaim there)",
            idle,
            quiet=False,
        )
    action = free_action(f)
    if action is not Action.UNLOAD and not f.has_handle:
        return Candidate(
            name,
            Action.KEEP,
            "its record names no server that gpuctl started: left alone",
            idle,
            quiet=False,
        )
    return Candidate(name, action, "idle " + versus(idle, f.idle_timeout_s, ">"), idle, quiet=False)
