"""Hostile input on the agent's wire, against the real agent on loopback and real files.

Each case here once made the agent accept what it must not, answer 5xx, or serve a stale
reading: a pid past the kernel's range, NaN, strings for numbers, deep nesting, a
trailing newline in a name, one bad record file, a read-only token that could write.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpuctl.adapters.store import AgentStore, holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent import wire
from gpuctl.agent.app import AgentSettings, create_app
from gpuctl.agent.http import HttpError
from gpuctl.agent.server import serve
from gpuctl.cli.app import create_app as create_cli
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import GpuProcess
from gpuctl.errors import UsageError
from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

TOKEN = "write-token"
READ = "read-only-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RO = {"Authorization": f"Bearer {READ}"}
SVC = "vllm"


@dataclass
class Agent:
    url: str
    probe: FakeProbe
    state: Path

    def post(self, path: str, body: Any = None, *, raw: bytes | None = None) -> httpx.Response:
        content = raw if raw is not None else json.dumps(body).encode()
        return httpx.post(
            f"{self.url}{path}",
            headers={**AUTH, "Content-Type": "application/json"},
            content=content,
        )


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    state = tmp_path / "state"
    probe = FakeProbe(reading_of())
    # A long TTL: a test that sees a change sees it because the cache was bypassed or
    # invalidated, never because it expired.
    settings = AgentSettings(token=TOKEN, read_token=READ, cache_ttl_s=300.0, state_dir=str(state))
    with serve_in_thread(create_app(settings, probe)) as url:
        yield Agent(url, probe, state)


def holder_dict(**over: Any) -> dict[str, Any]:
    return {**holder_here("test").to_dict(), **over}


# --------------------------------------------------------------------------- bodies


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/lease", {"holder": holder_dict(pid=2147483648), "ttl_s": 60}, "holder.pid"),
        ("/lease", {"holder": holder_dict(pid=-1), "ttl_s": 60}, "holder.pid"),
        ("/lease", {"holder": holder_dict(pid="12"), "ttl_s": 60}, "holder.pid"),
        ("/lease", {"holder": holder_dict(pid=12.5), "ttl_s": 60}, "holder.pid"),
        ("/lease", {"holder": holder_dict(pid=True), "ttl_s": 60}, "holder.pid"),
        ("/lease", {"holder": holder_dict(pid_start=1e308), "ttl_s": 60}, "holder.pid_start"),
        ("/lease", {"holder": holder_dict(id=""), "ttl_s": 60}, "holder.id"),
        ("/lease", {"holder": holder_dict(), "ttl_s": "60"}, "ttl_s"),
        ("/lease", {"holder": holder_dict(), "ttl_s": 1e12}, "ttl_s"),
        ("/lease", {"holder": holder_dict(), "ttl_s": 60, "extra": 1}, "extra"),
        ("/lease", {"holder": holder_dict(boot_id=["x"]), "ttl_s": 60}, "holder.boot_id"),
        ("/touch", {"ready": "no"}, "ready"),
        ("/touch", {"ready": 0}, "ready"),
    ],
)
def test_a_bad_value_is_a_400_naming_its_field(
    agent: Agent, path: str, body: dict[str, Any], field: str
) -> None:
    r = agent.post(f"/records/{SVC}{path}", body)
    assert r.status_code == 400, r.text
    assert f"{field}:" in r.json()["error"]
    assert not (agent.state / "records" / f"{SVC}.json").exists()  # nothing written


HUGE = 10**400  # JSON allows it; no float holds it


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/events", {"events": [{"at": HUGE, "kind": "admit", "service": SVC}]}, "event.at"),
        ("/events", {"events": [{"at": 1.0, "kind": "admit", "service": SVC,
                                 "figures": {"n": HUGE}}]}, "event.figures"),
        ("/events", {"events": [{"at": 1e300, "kind": "admit", "service": SVC}]}, "event.at"),
        (f"/records/{SVC}/lease", {"holder": holder_dict(), "ttl_s": 60,
                                   "event": {"at": HUGE, "kind": "admit", "service": SVC}},
         "event.at"),
    ],
)  # fmt: skip
def test_a_hostile_event_is_a_400_naming_its_field(
    agent: Agent, path: str, body: dict[str, Any], field: str
) -> None:
    r = agent.post(path, body)
    assert r.status_code == 400, r.text
    assert f"{field}:" in r.json()["error"]


def test_a_poisoned_pid_never_reaches_the_store(agent: Agent) -> None:
    r = agent.post(f"/records/{SVC}/lease", {"holder": holder_dict(pid=2147483648), "ttl_s": 60})
    assert r.status_code == 400
    assert "holder.pid: 2147483648 is out of range (1..4194304)" in r.json()["error"]
    # ... and the store keeps working for everyone.
    assert httpx.get(f"{agent.url}/records", headers=AUTH).status_code == 200
    assert httpx.get(f"{agent.url}/metrics", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"holder": {"id": "h"}, "ttl_s": NaN}',
        b'{"holder": {"id": "h"}, "ttl_s": Infinity}',
        b'{"holder": {"id": "h"}, "ttl_s": -Infinity}',
        b'{"holder": {"id": "h"}, "ttl_s": 1e400}',
        b'{"holder": {"id": "h", "pid": 1' + b"0" * 5000 + b'}, "ttl_s": 5}',
        b"[" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": ' * 20 + b"1" + b"}" * 20,
        b"\xff\xfe not utf-8",
        b'"just a string"',
        b"{",
    ],
)
def test_hostile_bodies_are_400(agent: Agent, raw: bytes) -> None:
    r = agent.post(f"/records/{SVC}/lease", raw=raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("bad request body")


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"phase": "bogus"}, "update.phase"),
        ({"touch": "no"}, "update.touch"),
        ({"lease": None}, "update"),
        ({"handle": {"kind": "process", "pid": 2147483648}}, "update.handle.pid"),
        ({"handle": "x"}, "update.handle"),
        ({"failure": {"error": 5}}, "update.failure.error"),
        ({"attempt": {"started": "yesterday"}}, "update.attempt.started"),
    ],
)
def test_an_invalid_update_is_400_not_503(agent: Agent, update: dict[str, Any], field: str) -> None:
    h = holder_dict()
    assert agent.post(f"/records/{SVC}/lease", {"holder": h, "ttl_s": 60}).status_code == 200
    r = httpx.patch(
        f"{agent.url}/records/{SVC}", headers=AUTH, json={"holder": h["id"], "update": update}
    )
    assert r.status_code == 400, r.text
    assert f"{field}:" in r.json()["error"]
    r = agent.post(f"/records/{SVC}/lease/release", {"holder": h["id"], "update": update})
    assert r.status_code == 400, r.text
    # Nothing changed: the lease is still held, the phase as it was.
    rec = DirectStore(agent.state).get(SVC)
    assert rec.lease is not None and rec.phase.value == "stopped"


# --------------------------------------------------------------------------- HTTP


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("POST", "/records", "GET, HEAD"),
        ("DELETE", f"/records/{SVC}", "GET, HEAD, PATCH"),
        ("GET", f"/records/{SVC}/lease", "POST"),
        ("PUT", f"/records/{SVC}/touch", "POST"),
        ("POST", "/status", "GET, HEAD"),
        ("DELETE", "/metrics", "GET, HEAD"),
    ],
)
def test_405_carries_allow(agent: Agent, method: str, path: str, allow: str) -> None:
    r = httpx.request(method, f"{agent.url}{path}", headers=AUTH)
    assert r.status_code == 405
    assert r.headers["allow"] == allow


@pytest.mark.parametrize(
    "path", ["/healthz", "/openapi.json", "/status", "/metrics", "/records", f"/records/{SVC}"]
)
def test_head_works_where_get_does(agent: Agent, path: str) -> None:
    get = httpx.get(f"{agent.url}{path}", headers=AUTH)
    head = httpx.head(f"{agent.url}{path}", headers=AUTH)
    assert get.status_code == head.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


@pytest.mark.parametrize(
    "name", ["vllm%0A", "vllm%0D%0A", "%0Avllm", "vllm%00", "-vllm", "a" * 102]
)
def test_service_names_are_matched_whole(agent: Agent, name: str) -> None:
    r = httpx.get(f"{agent.url}/records/{name}", headers=AUTH)
    assert r.status_code == 400
    assert "invalid service name" in r.json()["error"]


# --------------------------------------------------------------------------- bad records on disk


@pytest.mark.parametrize(
    "poison",
    [
        {"lease": {"holder": "h", "pid": 2147483648, "expires": 9e9, "host": "", "boot_id": ""}},
        {"handle": {"kind": "process", "pid": 2147483648}, "phase": "running"},
        {"since": "yesterday"},
    ],
)
def test_one_bad_record_never_takes_records_or_metrics_down(
    agent: Agent, poison: dict[str, Any]
) -> None:
    store = DirectStore(agent.state)
    h = holder_here("test")
    store.acquire("good", h, 60)
    store.release("good", h.id, RecordUpdate.from_wire({"phase": "running"}))
    bad = {**store.get("good").to_dict(), "service": "bad", **poison}
    from gpuctl.adapters.procinfo import host_identity

    here = host_identity()
    if "lease" in poison:
        # A lease taken here: the store asks whether its holder pid still runs.
        bad["lease"] = {**poison["lease"], "host": here.hostname, "boot_id": here.boot_id}
    (agent.state / "records" / "bad.json").write_text(json.dumps(bad))
    r = httpx.get(f"{agent.url}/records", headers=AUTH)
    assert r.status_code == 200, r.text
    assert "good" in [rec["service"] for rec in r.json()["records"]]
    m = httpx.get(f"{agent.url}/metrics", headers=AUTH)
    assert m.status_code == 200, m.text
    assert 'gpuctl_service_phase{service="good"' in m.text
    one = httpx.get(f"{agent.url}/records/bad", headers=AUTH)
    assert one.status_code < 500 or one.status_code == 503  # never a 500
    assert one.status_code != 500


# --------------------------------------------------------------------------- fresh truth


BUSY = GpuProcess(pid=777, command="vllm serve big", memory_mib=70_000)


def status(agent: Agent, **params: str) -> dict[str, Any]:
    r = httpx.get(f"{agent.url}/status", params=params, headers=AUTH)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_fresh_bypasses_the_reading_cache(agent: Agent) -> None:
    assert status(agent)["is_idle"]
    agent.probe.reading = reading_of(BUSY)
    assert status(agent)["is_idle"]  # cached for 300 s
    assert not status(agent, fresh="1")["is_idle"]
    assert not status(agent, fresh="1", match="vllm")["is_idle"]
    bad = httpx.get(f"{agent.url}/status", params={"fresh": "maybe"}, headers=AUTH)
    assert bad.status_code == 400


def settled(folder: Path) -> None:
    """Wait (on the condition, not a fixed sleep) until ``folder``'s mtime is older than
    the agent's settle time, after which an unchanged stamp means "unchanged"."""
    from gpuctl.agent.cache import SETTLE_NS

    deadline = time.monotonic() + 30
    while time.time_ns() - os.stat(folder).st_mtime_ns <= SETTLE_NS:
        assert time.monotonic() < deadline, f"{folder} keeps changing"
        time.sleep(0.01)


def listed(agent: Agent, **params: str) -> list[int]:
    """The pids /status lists on the GPU: what tells a fresh reading from a cached one
    (``is_idle`` also reads the records, at every answer)."""
    return [p["pid"] for p in status(agent, **params)["processes"] if p["on_gpu"]]


@pytest.mark.parametrize("write", ["lease", "renew", "release", "update", "touch"])
def test_every_store_write_invalidates_the_reading(agent: Agent, write: str) -> None:
    assert listed(agent) == []
    assert listed(agent, match="vllm") == []
    store = AgentStore(agent.url, TOKEN)
    try:
        h = holder_here("test")
        if write != "lease":
            store.acquire(SVC, h, 60)
            assert listed(agent) == []  # that write was seen
            # Now cache again, once the records folder's stamp has settled: a stamp
            # younger than SETTLE_NS counts as changed on every look (FolderStamp).
            settled(agent.state / "records")
            assert listed(agent) == []
        agent.probe.reading = reading_of(BUSY)
        assert listed(agent) == []
        if write == "lease":
            store.acquire(SVC, h, 60)
        elif write == "renew":
            store.renew(SVC, h.id, 60)
        elif write == "release":
            store.release(SVC, h.id, RecordUpdate.from_wire({"phase": "running"}))
        elif write == "update":
            store.update(SVC, h.id, RecordUpdate.from_wire({"phase": "starting"}))
        else:
            store.touch(SVC)
    finally:
        store.close()
    assert listed(agent) == [777]
    assert listed(agent, match="vllm") == [777]


@pytest.mark.parametrize("match", [None, "vllm"])
def test_is_idle_is_false_while_a_lease_is_held_with_no_process_yet(
    agent: Agent, match: str | None
) -> None:
    """The 15-50 ms between a start taking its lease and its server existing said
    is_idle: true to the original API's pollers, who then started their own server.
    The lease is taken straight through the files (a client on the host without the
    agent), after an idle answer was cached: the next answer is not idle."""
    params = {"match": match} if match else {}
    store = DirectStore(agent.state)
    h = holder_here("test")
    store.acquire("other", h, 60)  # a stopped record: the records folder exists
    store.release("other", h.id)
    assert status(agent, **params)["is_idle"]
    settled(agent.state / "records")
    assert status(agent, **params)["is_idle"]  # cached, the stamp unchanged
    store.acquire(SVC, h, 60)
    body = status(agent, **params)
    assert body["is_idle"] is False and body["processes"] == []
    store.release(SVC, h.id)
    assert status(agent, **params)["is_idle"]


def test_is_idle_is_false_while_a_record_says_starting(agent: Agent) -> None:
    """A start whose caller let go of the lease (``--no-wait``) before its server shows."""
    store = DirectStore(agent.state)
    h = holder_here("test")
    store.acquire("other", h, 60)
    store.release("other", h.id)
    assert status(agent)["is_idle"]
    settled(agent.state / "records")
    store.acquire(SVC, h, 60)
    store.release(SVC, h.id, RecordUpdate.from_wire({"phase": "starting"}))
    assert store.get(SVC).lease is None
    body = status(agent)
    assert body["is_idle"] is False and body["processes"] == []
    # A client of the agent takes that answer as it is: not idle, no process.
    from gpuctl.core.status_wire import parse_status

    assert parse_status(body).is_idle is False


def test_a_write_refreshes_the_process_scan_too(agent: Agent) -> None:
    """Right after a launch, the new server shows up under `starting` at once."""
    kw = f"fresh-{time.time_ns()}"
    assert status(agent, match=kw)["starting"] == []
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", kw])
    try:
        assert status(agent, match=kw)["starting"] == []  # the scan is cached
        store = AgentStore(agent.url, TOKEN)
        try:
            store.touch(SVC)
        finally:
            store.close()
        assert [s["pid"] for s in status(agent, match=kw)["starting"]] == [proc.pid]
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- read-only token


def test_the_read_token_reads_everything_and_writes_nothing(agent: Agent) -> None:
    for path in ("/status", "/status?match=vllm", "/metrics", "/records", f"/records/{SVC}"):
        assert httpx.get(f"{agent.url}{path}", headers=RO).status_code == 200, path
        assert httpx.head(f"{agent.url}{path}", headers=RO).status_code == 200, path
    h = holder_dict()
    writes = [
        ("POST", f"/records/{SVC}/lease", {"holder": h, "ttl_s": 60}),
        ("POST", f"/records/{SVC}/lease/renew", {"holder": h["id"], "ttl_s": 60}),
        ("POST", f"/records/{SVC}/lease/release", {"holder": h["id"]}),
        ("PATCH", f"/records/{SVC}", {"holder": h["id"], "update": {}}),
        ("POST", f"/records/{SVC}/touch", {}),
    ]
    for method, path, body in writes:
        r = httpx.request(method, f"{agent.url}{path}", headers=RO, json=body)
        assert r.status_code == 403, (path, r.text)
        assert "read-only" in r.json()["error"]
    assert not (agent.state / "records" / f"{SVC}.json").exists()
    wrong = httpx.get(f"{agent.url}/status", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_a_read_token_needs_a_write_token_of_its_own() -> None:
    with pytest.raises(UsageError, match="needs a write token"):
        serve("127.0.0.1:0", "sim", None, read_token=READ)
    with pytest.raises(UsageError, match="is the write token"):
        serve("127.0.0.1:0", "sim", TOKEN, read_token=TOKEN)


# --------------------------------------------------------------------------- numbers on the command line


@pytest.mark.parametrize("option", ["--cache-ttl", "--match-max-age"])
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "1e400", "0s", "-inf"])
def test_durations_must_be_finite_and_positive(cli_env: Path, option: str, value: str) -> None:
    result = CliRunner().invoke(create_cli(), ["agent", "--probe", "sim", option, value])
    assert result.exit_code == 2, result.output
    assert f"{option}:" in result.output
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- /status parameters


@pytest.mark.parametrize(
    "params",
    [
        {"fersh": "1"},
        {"fresh": "yes"},
        {"match": ",".join(f"k{i}" for i in range(33))},
        {"match": "x" * 201},
        {"match": "a", "pids": "0"},
        {"match": "a", "pids": "4194305"},
        {"match": "a", "pids": "1,,2"},
        {"pids": "12x"},  # checked even where it would be ignored
        {"exclude": "-1"},
        {"pipes": "pipe:[1]"},
    ],
)
def test_bad_status_parameters_are_400(agent: Agent, params: dict[str, str]) -> None:
    r = httpx.get(f"{agent.url}/status", params=params, headers=AUTH)
    assert r.status_code == 400, r.text


def test_json_integers_may_be_written_as_floats(agent: Agent) -> None:
    """JSON has one number type: 4242.0 is the integer 4242 (JSON Schema agrees)."""
    h = holder_dict()
    r = agent.post(f"/records/{SVC}/lease", {"holder": {**h, "pid": float(h["pid"])}, "ttl_s": 60})
    assert r.status_code == 200, r.text
    assert r.json()["record"]["lease"]["pid"] == h["pid"]


# --------------------------------------------------------------------------- properties (pure)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
VALIDATORS = [
    wire.lease_request,
    wire.renew_request,
    wire.holder_update,
    wire.release_request,
    wire.touch_request,
    wire.end_request,
    wire.inflight_request,
]


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_body_is_an_object_or_a_4xx(body: bytes) -> None:
    try:
        data = wire.parse_body(body)
    except HttpError as err:
        assert 400 <= err.status < 500
    else:
        assert isinstance(data, dict)


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["holder", "ttl_s", "update", "ready", "x"]), json_values, max_size=4
    )
)
def test_any_object_passes_a_validator_or_is_a_400_naming_a_field(data: dict[str, object]) -> None:
    for check in VALIDATORS:
        try:
            check(data)
        except wire.BadRequest as err:
            assert err.status == 400
            assert err.error.startswith("bad request body")


SECRET_HEALTH = "http://gpuctl:hunter2@127.0.0.1:8000/health?token=tok-77e1&x=1"


def test_the_read_token_sees_a_records_secrets_masked_the_write_token_as_written(
    agent: Agent,
) -> None:
    h = holder_dict()
    assert agent.post(f"/records/{SVC}/lease", {"holder": h, "ttl_s": 60}).status_code == 200
    update = {
        "health": SECRET_HEALTH,
        "failure": {"error": "exited 1", "log_tail": "args: --api-key sk-live-9c1d\nbye"},
        "attempt": {"outcome": "failed", "error": "curl -H 'Authorization: Bearer tok-77e1'"},
    }
    r = agent.post(f"/records/{SVC}/lease/release", {"holder": h["id"], "update": update})
    assert r.status_code == 200, r.text
    for path in ("/records", f"/records/{SVC}"):
        body = httpx.get(f"{agent.url}{path}", headers=RO).text
        for secret in ("hunter2", "tok-77e1", "sk-live-9c1d"):
            assert secret not in body, (path, secret)
        # Still readable as what it is: the URL, its host, the names of what was masked.
        assert "http://gpuctl:***@127.0.0.1:8000/health?token=***&x=1" in body, body
        assert "--api-key ***" in body
        # The write token's client fetches that URL: it gets it as written.
        full = httpx.get(f"{agent.url}{path}", headers=AUTH).json()
        record = full["records"][0] if path == "/records" else full
        assert record["health"] == SECRET_HEALTH


def test_openapi_documents_403_and_413_where_the_agent_answers_them(agent: Agent) -> None:
    doc = httpx.get(f"{agent.url}/openapi.json").json()
    ops = [
        (path, method, spec["responses"])
        for path, item in doc["paths"].items()
        if path.startswith("/records")
        for method, spec in item.items()
        if method != "parameters"
    ]
    assert len(ops) >= 14
    for path, method, responses in ops:
        # Every /records request's body is read (and bounded) before it is routed.
        assert "413" in responses, (method, path)
        # Every write is refused to the read-only token.
        assert ("403" in responses) == (method != "get"), (method, path)
    # And the agent does answer them so, where the document says.
    big = {"holder": "x" * (wire.MAX_BODY_BYTES + 1), "ttl_s": 1}
    assert agent.post(f"/records/{SVC}/lease/renew", big).status_code == 413
    r = httpx.post(f"{agent.url}/records/_queue/leave", headers=RO, json={"holder": "a1"})
    assert r.status_code == 403


# --------------------------------------------------------------------------- one home each


def test_json_kind_names_each_json_value_as_errors_quote_it() -> None:
    from gpuctl.core.json_kind import json_kind

    cases: list[tuple[Any, str]] = [
        (None, "null"),
        (True, "a boolean"),
        (7, "an integer"),
        (7.5, "a number"),
        ("x", "a string"),
        ([], "an array"),
        ({}, "an object"),
    ]
    assert [json_kind(v) for v, _ in cases] == [k for _, k in cases]
    assert json_kind(7, integers=False) == "a number"
    assert json_kind(False, integers=False) == "a boolean"


def test_the_pid_bound_and_the_name_rule_have_one_home_each() -> None:
    """A copy drifts: the bound lives in gpuctl.core.pids, the name rule in core.names."""
    import re

    root = Path(__file__).resolve().parents[1] / "gpuctl"
    copies = {
        "the pid bound": re.compile(
            r"^\w*PID_\w+\s*(?::\s*\w+)?\s*=\s*(1 << 22|4_?194_?304)", re.M
        ),
        "the name rule": re.compile(re.escape("[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}")),
        "a JSON kind helper": re.compile(r'return "an array"'),
    }
    homes = {
        "the pid bound": "core/pids.py",
        "the name rule": "core/names.py",
        "a JSON kind helper": "core/json_kind.py",
    }
    for what, pattern in copies.items():
        found = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*.py")
            if pattern.search(p.read_text(encoding="utf-8"))
        )
        assert found == [homes[what]], what


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/ui", {}, 200),
        ("/ui/app.js", {}, 200),
        ("/ui/state", RO, 200),
        ("/ui/state", {}, 401),
        ("/ui/%3Cscript%3Ealert(1)%3C%2Fscript%3E", {}, 404),
        ("/ui/app.js/", {}, 404),
    ],
)
def test_every_answer_under_ui_carries_the_csp(
    agent: Agent, path: str, headers: dict[str, str], status: int
) -> None:
    """The page's CSP and nosniff on every answer under /ui: its data, a refusal, and a
    404 that quotes the path it was asked for."""
    r = httpx.get(f"{agent.url}{path}", headers=headers)
    assert r.status_code == status, r.text
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    assert len(r.headers.get_list("content-security-policy")) == 1


def test_slow_actions_from_the_page_never_hold_the_agents_reads(tmp_path: Path) -> None:
    """As many ``POST /actions/stop`` as the shared thread pool has threads, each held
    (a stop waits out its server's grace period): ``GET /records`` and ``GET /events``,
    which read in worker threads, still answer."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from gpuctl.agent import ui

    started, release = threading.Semaphore(0), threading.Event()

    class HeldBackend:  # the config's flows, as slow as a stop of a deaf server
        has_config = True

        def status(self) -> dict[str, Any] | None:
            return None

        def act(
            self, op: str, service: str, seen: dict[str, str] | None = None
        ) -> tuple[int, dict[str, Any]]:
            started.release()
            release.wait(60)
            return 200, {"ok": True, "message": f"{op} {service}"}

    n = min(32, (os.cpu_count() or 1) + 4) + 2
    state = tmp_path / "state"
    settings = AgentSettings(token=TOKEN, read_token=READ, cache_ttl_s=300.0, state_dir=str(state))
    app = create_app(settings, FakeProbe(reading_of()), HeldBackend())
    with serve_in_thread(app) as url, ThreadPoolExecutor(n) as pool:
        try:
            posts = [
                pool.submit(
                    httpx.post,
                    f"{url}/actions/stop",
                    json={"service": f"svc{i}"},
                    headers=AUTH,
                    timeout=120,
                )
                for i in range(n)
            ]
            for _ in range(ui.ACTION_WORKERS):
                assert started.acquire(timeout=60), "the actions did not begin"
            for path in ("/records", "/events?since=1h"):
                r = httpx.get(f"{url}{path}", headers=RO, timeout=30)
                assert r.status_code == 200, (path, r.text)
        finally:
            release.set()
        assert all(p.result().status_code == 200 for p in posts)
