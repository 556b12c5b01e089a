"""The Slurm launcher against a hostile or broken cluster: another user's jobs that copy
gpuctl's name and comment, an sbatch that times out or prints nonsense, squeue output
that is not UTF-8 or names no host, a job that will not leave the queue.

``sbatch``, ``squeue`` and ``scancel`` are one small fake (``FAKE`` below) named in the
host's ``[hosts.X.slurm]`` command paths; it keeps its queue in a JSON file and logs
every call, so each case is pure and fast. (The real cluster: tests/test_launcher_slurm.py.)
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpuctl.adapters.launchers import slurm as slurm_mod
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.slurm import SlurmLauncher, current_user, first_host
from gpuctl.config import parse_config
from gpuctl.core.record import Record
from gpuctl.errors import LauncherError, StartFailed, Unproven
from gpuctl.flows.look import Observation, slurm_placed
from tests.conftest import gpuctl

FAKE = r"""
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
tool, args = sys.argv[1], sys.argv[2:]
path = os.path.join(here, "queue.json")
q = json.load(open(path))
with open(os.path.join(here, "calls.jsonl"), "a") as log:
    log.write(json.dumps([tool, *args]) + "\n")
def opt(name):
    return args[args.index(name) + 1] if name in args else None
if tool == "squeue":
    if q.get("squeue_raw"):
        sys.stdout.buffer.write(bytes.fromhex(q["squeue_raw"]))
        sys.exit(0)
    keys = {"i": "id", "T": "state", "r": "reason", "N": "node", "u": "user",
            "j": "name", "k": "comment"}
    fields = [keys[f.strip("%")] for f in opt("--format").split("|")]
    for job in q["jobs"]:
        if opt("--name") not in (None, job["name"]) or opt("--jobs") not in (None, job["id"]):
            continue
        print("|".join(job[f] for f in fields))
elif tool == "sbatch":
    b = q["sbatch"]
    job = {"id": str(len(q["jobs"]) + 100), "state": "RUNNING", "reason": "None",
           "node": q.get("node", "n1"), "user": q["me"], "name": opt("--job-name"),
           "comment": opt("--comment")}
    if b.get("submits", True):
        q["jobs"].append(job)
        json.dump(q, open(path, "w"))
    if b.get("hang"):
        time.sleep(60)
    sys.stdout.write(b.get("says", job["id"] + "\n"))
elif tool == "scancel":
    if q.get("scancel_ends", True):
        for job in q["jobs"]:
            if job["id"] == args[-1]:
                job["state"] = "CANCELLED"
        json.dump(q, open(path, "w"))
"""

ME = current_user()


class Cluster:
    """The fake's queue and its call log, in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "fake.py").write_text(FAKE)
        self.queue: dict[str, Any] = {"me": ME, "jobs": [], "sbatch": {}}
        self.save()
        for tool in ("sbatch", "squeue", "scancel"):
            script = root / tool
            script.write_text(f'#!/bin/sh\nexec {sys.executable} {root / "fake.py"} {tool} "$@"\n')
            script.chmod(0o755)

    def save(self) -> None:
        (self.root / "queue.json").write_text(json.dumps(self.queue))

    def add(self, **job: str) -> None:
        base = {"state": "RUNNING", "reason": "None", "node": "n1", "user": ME, "comment": ""}
        self.queue["jobs"].append({**base, **job})
        self.save()

    def calls(self, tool: str) -> list[list[str]]:
        path = self.root / "calls.jsonl"
        rows = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
        return [r[1:] for r in rows if r[0] == tool]

    def launcher(self) -> SlurmLauncher:
        config = parse_config(
            {
                "hosts": {
                    "c": {"slurm": {t: str(self.root / t) for t in ("sbatch", "squeue", "scancel")}}
                },
                "services": {"s": {"launcher": "slurm", "command": "serve", "host": "c"}},
            }
        )
        slurm = config.hosts["c"].slurm
        assert slurm is not None
        return SlurmLauncher(slurm, log_dir=self.root / "logs", host="c")


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    return Cluster(tmp_path)


def service(log: str | None = None) -> Any:
    svc = {"launcher": "slurm", "command": "serve", "host": "c"}
    if log is not None:
        svc["log"] = log
    return parse_config({"hosts": {"c": {"slurm": {}}}, "services": {"s": svc}}).services["s"]


# -- 1, 2: another user's job with gpuctl's name and comment ------------------------


def test_another_users_job_is_no_node_of_ours(cluster: Cluster) -> None:
    cluster.add(id="7", name="gpuctl-s", user="mallory", node="evil", comment="gpuctl:n1")
    lx = cluster.launcher()
    assert lx.node_of("s") is None
    cluster.add(id="8", name="gpuctl-s", comment="gpuctl:other", node="mine")
    assert lx.node_of("s") == "mine"
    # With the record's nonce, only the job that start submitted counts.
    assert lx.node_of("s", "n1") is None
    assert lx.node_of("s", "other") == "mine"


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[int]:
    """The port of a server on loopback that answers every GET with 200."""
    server = HTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def node_service_config(cluster: Cluster, port: int, tmp_path: Path) -> Path:
    """A config whose service ``s`` runs on the fake cluster, its health on ``{node}``."""
    tools = "".join(f'{t} = "{cluster.root / t}"\n' for t in ("sbatch", "squeue", "scancel"))
    cfg = tmp_path / "gpuctl.toml"
    cfg.write_text(
        f'[hosts.c]\nprobe = "sim"\nsim_dir = "{tmp_path / "sim"}"\n\n[hosts.c.slurm]\n{tools}\n'
        '[services.s]\nhost = "c"\nlauncher = "slurm"\ncommand = "serve"\n'
        f'health = "http://{{node}}:{port}/health"\nhealth_timeout = "30s"\n'
    )
    return cfg


def test_ensure_submits_its_own_job_beside_another_users(
    cluster: Cluster, answering: int, tmp_path: Path
) -> None:
    # mallory's job copies the name; a server answers on its node. It is not ours: ensure
    # must submit (once) and be ready from its own job, never from mallory's.
    cluster.add(id="7", name="gpuctl-s", user="mallory", node="127.0.0.1", comment="gpuctl:x")
    cluster.queue["node"] = "127.0.0.1"
    cluster.save()
    cfg = node_service_config(cluster, answering, tmp_path)
    r = gpuctl(cfg, "ensure", "s", "--json", env={"GPUCTL_STATE_DIR": str(tmp_path / "state")})
    assert json.loads(r.stdout)["outcome"] == "ready", (r.stdout, r.stderr)
    assert len(cluster.calls("sbatch")) == 1


def test_find_and_stop_ignore_a_copied_name_and_comment(cluster: Cluster) -> None:
    cluster.add(id="7", name="gpuctl-s", user="mallory", comment="gpuctl:n1")
    lx = cluster.launcher()
    assert lx.find(service(), "n1") is None
    with pytest.raises(Unproven) as e:
        lx.stop(Handle(kind="slurm", job_id="7", proof="n1"), grace_s=0, service="s")
    assert e.value.message == "Slurm job 7 is mallory's, not " + ME + "'s"
    assert e.value.hint
    assert cluster.calls("scancel") == []


# -- 3, 15: an sbatch that fails to say what it did ---------------------------------


def test_a_timed_out_sbatch_that_submitted_is_adopted(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurm_mod, "CALL_TIMEOUT_S", 1.0)
    cluster.queue["sbatch"] = {"hang": True}
    cluster.save()
    handle = cluster.launcher().start(service(), "n1")
    assert handle.job_id == "100" and handle.proof == "n1"
    assert len(cluster.calls("sbatch")) == 1


def test_a_timed_out_sbatch_that_did_not_submit_fails(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurm_mod, "CALL_TIMEOUT_S", 1.0)
    cluster.queue["sbatch"] = {"hang": True, "submits": False}
    cluster.save()
    with pytest.raises(StartFailed) as e:
        cluster.launcher().start(service(), "n1")
    assert e.value.message == "sbatch did not answer within 1s"


def test_an_unparseable_sbatch_answer_that_submitted_is_adopted(cluster: Cluster) -> None:
    cluster.queue["sbatch"] = {"says": "Submitted batch job 100\n"}
    cluster.save()
    handle = cluster.launcher().start(service(), "n1")
    assert handle.job_id == "100"


@pytest.mark.parametrize("says", ["Submitted batch job 100\n", "١٢\n", "12a\n", "_1\n", "\n"])
def test_an_sbatch_answer_that_is_no_job_id_fails_naming_sbatch(
    cluster: Cluster, says: str
) -> None:
    cluster.queue["sbatch"] = {"says": says, "submits": False}
    cluster.save()
    with pytest.raises(StartFailed) as e:
        cluster.launcher().start(service(), "n1")
    assert e.value.message.startswith("sbatch answered ")
    assert e.value.message.endswith("for s, not a job id")


@pytest.mark.parametrize("says", ["12\n", "12;cluster\n", "12_3\n"])
def test_sbatch_job_ids(cluster: Cluster, says: str) -> None:
    cluster.queue["sbatch"] = {"says": says, "submits": False}
    cluster.save()
    assert cluster.launcher().start(service(), "n1").job_id == says.strip().split(";")[0]


# -- 4: squeue output that is not UTF-8 ---------------------------------------------


def test_squeue_bytes_that_are_not_utf8(cluster: Cluster) -> None:
    cluster.queue["squeue_raw"] = f"5|PENDING|\xff\xfe|n1|{ME}|gpuctl-s|gpuctl:n1\n".encode(
        "latin-1"
    ).hex()
    cluster.save()
    lx = cluster.launcher()
    (job,) = lx.jobs(name="gpuctl-s")
    assert job.reason == "\ufffd\ufffd"
    assert lx.queue_state(Handle(kind="slurm", job_id="5")) == "queued by Slurm: \ufffd\ufffd"


# -- 5: a job that stays listed after scancel --signal KILL -------------------------


def test_stop_says_when_the_job_stays_listed(cluster: Cluster) -> None:
    cluster.add(id="7", name="gpuctl-s", comment="gpuctl:n1")
    cluster.queue["scancel_ends"] = False
    cluster.save()
    lx = cluster.launcher()
    lx.kill_wait_s = 0.0
    with pytest.raises(LauncherError) as e:
        lx.stop(Handle(kind="slurm", job_id="7", proof="n1"), grace_s=0, service="s")
    assert e.value.message == "Slurm job 7 is still listed (RUNNING) after scancel --signal KILL"
    assert e.value.hint
    assert cluster.calls("scancel")[-1] == ["--signal", "KILL", "--full", "7"]


def test_stop_of_our_job_cancels_it(cluster: Cluster) -> None:
    cluster.add(id="7", name="gpuctl-s", comment="gpuctl:n1")
    cluster.launcher().stop(Handle(kind="slurm", job_id="7", proof="n1"), grace_s=5, service="s")
    assert cluster.calls("scancel") == [["7"]]


# -- 12: %N that is no host name ----------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "host"),
    [
        ("n1", "n1"),
        ("gpu-01.cluster", "gpu-01.cluster"),
        ("a,b", "a"),
        ("node[01,03]", "node01"),
        ("node[07-09,11]", "node07"),
        ("rack[2-3]-n[4-5]x,z", "rack2-n4x"),
        ("node[01-02],other[3]", "node01"),
    ],
)
def test_first_host_of_a_node_list(nodes: str, host: str) -> None:
    assert first_host(nodes) == host


@pytest.mark.parametrize(
    "nodes", ["user:pw@host", "a b", "http://x/", "node[a-b]", "node[01", "nöde", "-n", ".n"]
)
def test_a_node_that_is_no_host_name_is_refused(cluster: Cluster, nodes: str) -> None:
    cluster.add(id="7", name="gpuctl-s", node=nodes)
    with pytest.raises(LauncherError) as e:
        cluster.launcher().node_of("s")
    assert e.value.message == f"squeue gave the node {nodes!r}, which is not a host name"


# -- 16: a log path Slurm would expand ----------------------------------------------


def test_a_percent_in_the_log_path_is_written_for_slurm(cluster: Cluster) -> None:
    log = cluster.root / "logs" / "s%j%%u.log"
    handle = cluster.launcher().start(service(str(log)), "n1")
    argv = cluster.calls("sbatch")[0]
    assert argv[argv.index("--output") + 1] == str(cluster.root / "logs" / "s%%j%%%%u.log")
    assert handle.log == str(log)


def test_a_backslash_in_the_log_path_is_refused(cluster: Cluster) -> None:
    with pytest.raises(StartFailed) as e:
        cluster.launcher().start(service(str(cluster.root / "logs" / "a\\b.log")), "n1")
    assert "backslash" in e.value.message
    assert cluster.calls("sbatch") == []


# -- 7: a forged handle kind for a configured service -------------------------------


def test_a_record_kind_counts_only_for_a_service_the_config_does_not_name() -> None:
    config = parse_config(
        {
            "hosts": {"c": {"slurm": {}}},
            "services": {
                "big": {"launcher": "process", "command": "serve", "host": "c", "memory": "100GiB"},
                "job": {"launcher": "slurm", "command": "serve", "host": "c"},
            },
        }
    )
    forged = {"kind": "slurm", "job_id": "1"}
    seen = Observation(
        records={
            "big": Record(service="big", handle=forged),
            "gone": Record(service="gone", handle=forged),
        }
    )
    assert slurm_placed(seen, list(config.services.values())) == {"job", "gone"}


# -- {node}: what the record keeps, what status and the agent read --------------------


def test_the_record_keeps_health_on_the_node_once_ensure_sees_it(
    cluster: Cluster, answering: int, tmp_path: Path
) -> None:
    """A start records no `{node}` template for the agent to poll (the node is not known
    yet); the ensure that sees the job answer records the URL on its node, which
    `status` asks and shows without asking squeue."""
    cluster.queue["node"] = "127.0.0.1"
    cluster.save()
    cfg = node_service_config(cluster, answering, tmp_path)
    env = {"GPUCTL_STATE_DIR": str(tmp_path / "state")}
    rec = tmp_path / "state" / "records" / "s.json"
    r = gpuctl(cfg, "ensure", "s", "--json", "--no-wait", env=env)
    assert json.loads(r.stdout)["outcome"] == "started", (r.stdout, r.stderr)
    assert json.loads(rec.read_text())["health"] is None
    # Status cannot know the node yet, and says so.
    r = gpuctl(cfg, "status", "--json", env=env)
    (s,) = [s for s in json.loads(r.stdout)["services"] if s["name"] == "s"]
    assert s["health"] == "none", s
    r = gpuctl(cfg, "ensure", "s", "--json", env=env)
    assert json.loads(r.stdout)["outcome"] == "ready", (r.stdout, r.stderr)
    url = f"http://127.0.0.1:{answering}/health"
    assert json.loads(rec.read_text())["health"] == url
    r = gpuctl(cfg, "status", "--json", env=env)
    (s,) = [s for s in json.loads(r.stdout)["services"] if s["name"] == "s"]
    assert (s["decision"], s["health"]) == ("READY", "ready"), s
    assert url in s["reason"], s
    assert len(cluster.calls("sbatch")) == 1


def test_status_asks_no_url_a_record_names_beside_the_template() -> None:
    """A record is anyone's to write: status asks its `health` only where it is the
    service's template with a host name for `{node}`."""
    from gpuctl.config.slurm_fields import node_of_url

    t = "http://{node}:8000/health"
    assert node_of_url(t, "http://n1.cluster:8000/health") == "n1.cluster"
    for forged in (
        None,
        t,
        "http://evil:9/x",
        "http://a@b:8000/health",
        "http://a:1/x:8000/health",
        "http://:8000/health",
        "http://n1:8000/healthz",
    ):
        assert node_of_url(t, forged) is None, forged


def test_the_agent_never_polls_a_node_template() -> None:
    from gpuctl.agent.upkeep import HealthGate
    from gpuctl.core.health_reach import HealthReach, parse_ports
    from gpuctl.core.record import Phase, Record

    gate = HealthGate(HealthReach(parse_ports("8000")), local=lambda: [])
    starting = Record("s", Phase.STARTING, health="http://{node}:8000/health")
    assert not gate.allows(starting)
    assert gate.allows(Record("s", Phase.STARTING, health="http://127.0.0.1:8000/health"))
