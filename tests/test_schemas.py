"""The JSON Schemas in schemas/ (draft 2020-12) against real output: the installed gpuctl's
``status``, ``ensure`` and ``locks`` with ``--json``, against a real agent on the
simulated GPU, in the states a script meets (ready, started, loading with a lease held,
busy, failed, timed out, a host down, a corrupt record set aside).

The schemas are generated from the Structs of ``gpuctl.render.schemas`` (a test diffs
the committed files against a fresh generation). Each output is checked three times:
by its Struct, against the schema as shipped (which lets a consumer validate newer
output that adds keys), and against a strict copy that refuses any key the schema does
not declare, so a key added to the output without being declared fails here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from jsonschema import Draft202012Validator, FormatChecker

from gpuctl.core.decision import Decision
from gpuctl.core.idle import Action
from gpuctl.core.record import Phase
from gpuctl.flows.op_results import Outcome
from gpuctl.render import schemas
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import config_env, gpuctl_either, gpuctl_exe, gpuctl_in_process
from tests.ensure_helpers import sim_claims, unique_name

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"

pytestmark = pytest.mark.e2e


def load(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return schema


def strict(schema: Any) -> Any:
    """The schema with every declared object closed (``additionalProperties: false``),
    except those it marks open on purpose (a launcher's handle)."""
    s = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for v in node.values():
                close(v)
        elif isinstance(node, list):
            for v in node:
                close(v)

    close(s)
    return s


def check(name: str, obj: Any) -> None:
    """``obj`` is a valid ``name`` output: its Struct takes it, and so do the generated
    schema and its strict copy."""
    struct = next(o.struct for o in schemas.OUTPUTS if o.name == name)
    try:
        msgspec.convert(obj, struct, strict=True)
    except msgspec.ValidationError as e:
        raise AssertionError(f"gpuctl.render.schemas.{struct.__name__} refuses it: {e}") from e
    schema = load(name)
    for variant in (schema, strict(schema)):
        v = Draft202012Validator(variant, format_checker=FormatChecker())
        errors = [f"{e.json_path}: {e.message}" for e in v.iter_errors(obj)]
        assert not errors, (
            f"schemas/{name}.schema.json does not match the real output "
            f"(document a new key there):\n" + "\n".join(errors[:10])
        )


NAMES = ["status", "ensure", "locks", "reclaim", "stop", "events", "usage"]


@pytest.mark.parametrize("name", NAMES)
def test_schema_is_valid_draft_2020_12(name: str) -> None:
    schema = load(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)
    Draft202012Validator.check_schema(strict(schema))


def test_enums_match_the_code() -> None:
    """Every value of each enum of the code, and no other (the generated schemas list
    them sorted)."""
    status, ensure, locks = load("status"), load("ensure"), load("locks")
    assert status["$defs"]["service"]["properties"]["decision"]["enum"] == sorted(
        d.value for d in Decision
    )
    assert ensure["properties"]["outcome"]["enum"] == sorted(o.value for o in Outcome)
    assert sorted(ensure["properties"]["exit_code"]["enum"]) == sorted(
        {int(o.exit_code) for o in Outcome}
    )
    assert locks["$defs"]["record"]["properties"]["phase"]["enum"] == sorted(p.value for p in Phase)
    actions = load("reclaim")["$defs"]["candidate"]["properties"]["action"]["enum"]
    assert actions == sorted(a.value for a in Action)
    resumed = load("reclaim")["$defs"]["resumed"]["properties"]["outcome"]["anyOf"][0]
    assert resumed["enum"] == sorted(o.value for o in Outcome)


def test_committed_schemas_are_generated_from_the_structs() -> None:
    """schemas/*.json are written by the generator from gpuctl.render.schemas's Structs:
    a hand edit, or a Struct changed without regenerating, fails here."""
    from gpuctl.render import schemas

    assert sorted(p.name for p in SCHEMAS.glob("*.schema.json")) == sorted(
        f"{o.name}.schema.json" for o in schemas.OUTPUTS
    )
    stale = schemas.stale(SCHEMAS)
    assert not stale, f"stale: {stale}; run `{schemas.REGENERATE}` and commit the result"


def test_the_generator_check_names_a_stale_file(tmp_path: Path) -> None:
    for o in schemas.OUTPUTS:
        (tmp_path / f"{o.name}.schema.json").write_text(schemas.rendered(o))
    assert schemas.stale(tmp_path) == []
    (tmp_path / "stop.schema.json").write_text("{}\n")
    assert schemas.stale(tmp_path) == ["stop.schema.json"]


def _fails(name: str, obj: Any) -> bool:
    try:
        check(name, obj)
    except AssertionError:
        return True
    return False


def test_the_checks_refuse_what_the_schemas_do_not_declare() -> None:
    """The generated schemas still fail bad output: an undeclared key (strict copy), a
    missing key, a value outside its enum or bounds, a timestamp of another form."""
    good = json.loads(docs_block("`gpuctl status --json`, in full:"))
    check("status", good)

    def bad(change: Any) -> Any:
        obj = copy.deepcopy(good)
        change(obj)
        return obj

    assert _fails("status", bad(lambda o: o.update(extra=1)))
    assert _fails("status", bad(lambda o: o["hosts"][0].update(extra=1)))
    assert _fails("status", bad(lambda o: o["hosts"][0].pop("devices")))
    assert _fails("status", bad(lambda o: o["services"][0].update(decision="MAYBE")))
    assert _fails("status", bad(lambda o: o["services"][0].update(pids=[0])))
    assert _fails("status", bad(lambda o: o.update(taken_at="2026-11-29T10:00:00Z")))
    assert _fails("status", bad(lambda o: o.update(schema=2)))
    stop = {
        "schema": 1,
        "service": "chat",
        "host": "sim",
        "stopped": [],
        "reason": "nothing ran",
        "exit_code": 0,
    }
    check("stop", stop)
    assert _fails("stop", {**stop, "exit_code": -1})
    assert _fails("stop", {k: v for k, v in stop.items() if k != "reason"})
    # A launcher's handle is open (its keys depend on the launcher), a voided row is not.
    ensure = {
        "schema": 1,
        "service": "chat",
        "host": "sim",
        "outcome": "ready",
        "exit_code": 0,
        "reason": "ready",
        "decision": "READY",
        "launched": False,
        "waited_s": 0.0,
        "attempt": None,
        "log_tail": "",
        "handle": {"kind": "process", "pid": 5, "log": "/x"},
        "notes": [],
        "hint": None,
        "pool": ["sim"],
    }
    check("ensure", ensure)
    assert _fails("ensure", {**ensure, "hint": ""})
    assert _fails("ensure", {**ensure, "exit_code": 2})


class Host:
    """A simulated host, its config, and the installed gpuctl run against it."""

    def __init__(self, sim: SimHost, config: Path, names: dict[str, str]) -> None:
        self.sim, self.config, self.names = sim, config, names

    def run(self, *args: str) -> tuple[int, Any]:
        r = gpuctl_either(config_env(self.config), *args, "--json")
        assert r.stdout.strip(), f"no JSON from {args}: {r.stderr}"
        return r.returncode, json.loads(r.stdout)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    root = tmp_path_factory.mktemp("schemas")
    with SimHost(root=root / "sim") as sim:
        sim.start_agent()
        n = {k: unique_name(k) for k in ("chat", "slow", "held", "idle", "broken", "huge", "far")}
        ports = {k: free_port() for k in n}
        py = sys.executable

        def server(key: str, memory: str, load: str) -> str:
            return (
                f"{py} -m gpuctl sim model-server --name {n[key]} --memory {memory} "
                f"--load-time {load} --port {ports[key]}"
            )

        broken = f"{py} -c 'import sys; print(\"boom\"); sys.exit(3)' {n['broken']}"
        config = sim.write_config(
            f"""
[hosts.down]
agent = "http://127.0.0.1:{free_port()}"
timeout = "1s"

[services.{n["chat"]}]
host = "sim"
launcher = "process"
command = {json.dumps(server("chat", "20GiB", "1s"))}
health = "http://127.0.0.1:{ports["chat"]}/health"
memory = "20GiB"

[services.{n["slow"]}]
host = "sim"
launcher = "process"
command = {json.dumps(server("slow", "10GiB", "600s"))}
health = "http://127.0.0.1:{ports["slow"]}/health"
memory = "10GiB"

[services.{n["held"]}]
host = "sim"
launcher = "process"
command = {json.dumps(server("held", "5GiB", "600s"))}
health = "http://127.0.0.1:{ports["held"]}/health"
memory = "5GiB"

[services.{n["idle"]}]
host = "sim"
launcher = "process"
command = {json.dumps(server("idle", "2GiB", "1s"))}
health = "http://127.0.0.1:{ports["idle"]}/health"
memory = "2GiB"
idle_timeout = "1s"

[services.{n["broken"]}]
host = "sim"
launcher = "process"
command = {json.dumps(broken)}
health = "http://127.0.0.1:{ports["broken"]}/health"
memory = "10GiB"

[services.{n["huge"]}]
host = "sim"
launcher = "process"
command = "sleep 1000"
health = "http://127.0.0.1:{ports["huge"]}/health"
memory = "120GiB"

[services.{n["far"]}]
host = "down"
health = "http://127.0.0.1:{ports["far"]}/health"
memory = "1GiB"
"""
        )
        h = Host(sim, config, n)
        comfy = unique_name("comfy")
        sim.hold(comfy, "20GiB")
        # The hold claims its memory once its interpreter is up: a view run at once (in
        # process, no start-up of its own) would see an empty GPU.
        deadline = time.monotonic() + 30
        while not sim_claims(sim, comfy):
            assert time.monotonic() < deadline, sim.log_tail(comfy)
            time.sleep(0.05)
        try:
            yield h
        finally:
            for key in ("chat", "slow", "held", "idle"):
                gpuctl_in_process(config, "stop", n[key])


def test_ensure_outcomes(host: Host) -> None:
    n = host.names
    seen: dict[str, int] = {}
    said: list[tuple[str, str, str]] = []
    for args in (
        [n["chat"]],  # started: launched, waited, an attempt and a handle
        [n["chat"]],  # ready at once
        [n["broken"]],  # failed, with its log tail
        [n["huge"]],  # busy, naming who holds the GPU
        [n["far"]],  # unknown: its host's agent is down
        [n["slow"], "--timeout", "2s"],  # timeout (and the server keeps loading)
    ):
        rc, obj = host.run("ensure", *args)
        check("ensure", obj)
        assert obj["exit_code"] == rc
        # No hint is null (as in status --json), never "": a refusal always has one.
        assert (obj["hint"] is None) == (rc == 0), obj
        seen[obj["outcome"]] = rc
        said.append((args[0], obj["outcome"], obj["reason"]))
    assert seen == {"ready": 0, "failed": 1, "busy": 3, "unknown": 4, "timeout": 5}, said


def test_status(host: Host) -> None:
    rc, obj = host.run("status")
    check("status", obj)
    assert rc == 4  # the host "down" is UNKNOWN
    by_name = {h["name"]: h for h in obj["hosts"]}
    assert by_name["sim"]["ok"] is True and by_name["sim"]["processes"]
    assert by_name["sim"]["state_dir"] and by_name["sim"]["taken_at"]
    assert by_name["down"]["ok"] is False and by_name["down"]["error"]


def test_locks_with_a_lease_held_and_a_corrupt_record(host: Host) -> None:
    n = host.names
    host.run("ensure", n["broken"])  # a failure and its back-off in the record
    # This server loads for minutes: the ensure that starts it holds the lease meanwhile.
    waiter = subprocess.Popen(
        [gpuctl_exe(), "ensure", n["held"], "--json", "--timeout", "300s"],
        env={**os.environ, "GPUCTL_CONFIG": str(host.config)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            rc, obj = host.run("locks")
            rows = {r.get("service"): r for r in obj["records"]}
            held = rows.get(n["held"])
            if held and held["lease"] is not None:
                break
            assert time.monotonic() < deadline, obj
            time.sleep(0.3)
        check("locks", obj)
        lease_rows = rows
        assert rc == 4 and obj["ok"] is False  # the host "down" is unreadable
        assert any(r.get("error") and r["host"] == "down" for r in obj["records"])
    finally:
        waiter.kill()
        waiter.wait()
    # A torn record is set aside, and the read that finds it reports it. That read must be
    # locks's own: so a state directory no agent watches, read directly.
    state = host.config.with_name("direct-state")
    (state / "records").mkdir(parents=True)
    (state / "records" / f"{n['huge']}.json").write_text('{"schema": 1, "service": ')
    direct = host.config.with_name("direct.toml")
    direct.write_text(
        f'[hosts.sim]\nprobe = "sim"\nsim_dir = "{host.sim.sim_dir}"\n\n'
        f'[services.{n["huge"]}]\nmemory = "120GiB"\n'
    )
    r = subprocess.run(
        [gpuctl_exe(), "locks", "--json"],
        env={**os.environ, "GPUCTL_CONFIG": str(direct), "GPUCTL_STATE_DIR": str(state)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    obj = json.loads(r.stdout)
    check("locks", obj)
    rows = {r.get("service"): r for r in obj["records"]}
    assert rows[n["huge"]]["recovered"], obj
    assert held["lease"]["expires_in_s"] > 0
    assert lease_rows[n["broken"]]["failure"]["count"] >= 1


@pytest.mark.slow
def test_reclaim_and_stop(host: Host) -> None:
    n = host.names
    for key in ("idle", "chat"):
        rc, obj = host.run("ensure", n[key])
        assert rc == 0, obj
    # Its idle_timeout is 1 s: once past it, reclaim plans a stop (and --dry-run stops nothing).
    deadline = time.monotonic() + 60
    while True:
        rc, plan = host.run("reclaim", "--host", "sim", "--dry-run")
        cands = {c["service"]: c for c in plan["candidates"]}
        if cands[n["idle"]]["action"] == "stop":
            break
        assert time.monotonic() < deadline, plan
        time.sleep(0.5)
    check("reclaim", plan)
    assert [h["hint"] for h in plan["hosts"]] == [None]
    assert all(c["hint"] is None for c in plan["candidates"])
    assert plan["dry_run"] is True and not cands[n["idle"]]["done"]

    rc, done = host.run("reclaim", "--host", "sim")
    check("reclaim", done)
    cands = {c["service"]: c for c in done["candidates"]}
    assert rc == 0 and cands[n["idle"]]["action"] == "stop" and cands[n["idle"]]["done"], done
    assert {c["action"] for c in done["candidates"]} >= {"stop", "keep"}

    rc, every = host.run("reclaim")  # the host "down" cannot be read: exit 4
    check("reclaim", every)
    assert rc == 4 and any(h["ok"] is False and h["error"] for h in every["hosts"])

    rc, stopped = host.run("stop", n["chat"])
    check("stop", stopped)
    assert rc == 0 and stopped["stopped"], stopped
    rc, nothing = host.run("stop", n["huge"])
    check("stop", nothing)
    assert rc == 0 and nothing["stopped"] == []


COMMANDS_PAGE = ROOT / "docs" / "reference" / "commands.md"


def docs_block(after: str) -> str:
    text = COMMANDS_PAGE.read_text()
    start = text.index(after)
    m = re.search(r"```json\n(.*?)```", text[start:], re.DOTALL)
    assert m, f"no JSON block after {after!r} in {COMMANDS_PAGE.name}"
    return m.group(1)


def test_docs_status_example_is_complete() -> None:
    """The commands reference's example of `gpuctl status --json` leaves out no key
    (state_dir, the host's taken_at, ...): it passes the strict schema, so it has every key
    and no other."""
    example = json.loads(docs_block("`gpuctl status --json`, in full:"))
    check("status", example)


def test_docs_point_to_the_schemas() -> None:
    for page in (COMMANDS_PAGE, ROOT / "docs" / "reference" / "schemas.md"):
        text = page.read_text()
        for name in NAMES:
            assert f"schemas/{name}.schema.json" in text, (page.name, name)


def test_every_format_a_schema_names_is_one_the_test_validator_knows() -> None:
    """conftest keeps jsonschema's "iri" format checks (rfc3987_syntax) out of the test
    workers; this holds only while no schema here names such a format. Every format the
    published schemas and both OpenAPI documents name is one jsonschema checks without
    it, or one OpenAPI defines for file bodies (``binary``), which no validator checks."""
    from gpuctl.agent.openapi import openapi_document as agent_document
    from gpuctl.proxy.openapi import openapi_document as proxy_document

    def formats(node: Any) -> set[str]:
        if isinstance(node, dict):
            own = {node["format"]} if isinstance(node.get("format"), str) else set()
            return own.union(*(formats(v) for v in node.values()))
        if isinstance(node, list):
            return set().union(*(formats(v) for v in node))
        return set()

    docs = [json.loads(p.read_text()) for p in sorted(SCHEMAS.glob("*.schema.json"))]
    docs += [agent_document(), proxy_document(["m"], ["s"])]
    named = set().union(*(formats(d) for d in docs))
    assert named, "no format found: the walk is wrong"
    assert named <= set(FormatChecker().checkers) | {"binary"}, named
