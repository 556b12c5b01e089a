"""A record written on another machine (or in another boot) names a pid of that
machine: it is never looked up here, so a `run.*` record naming pid 1 does not show
this machine's pid 1 as its job."""

from __future__ import annotations

from typing import Any

from gpuctl.adapters import procinfo
from gpuctl.adapters.recorded_servers import find_servers
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_pids import recorded_servers


def _job(host: str, boot: str, pid: int = 1) -> Record:
    handle: dict[str, Any] = {
        "kind": "run",
        "pid": pid,
        "memory_mib": 1024,
        "priority": 50,
        "host": host,
        "boot_id": boot,
    }
    return Record(service="run.x", phase=Phase.RUNNING, handle=handle)


def test_another_hosts_or_boots_pid_is_not_looked_up_here() -> None:
    me = procinfo.host_identity()
    assert find_servers([_job("elsewhere", me.boot_id)]) == {}
    assert find_servers([_job(me.hostname, "an-older-boot")]) == {}
    assert find_servers([_job(me.hostname, me.boot_id)]) == {1: "run.x"}


def test_recorded_servers_without_here_or_without_a_place_keep_the_pid() -> None:
    assert recorded_servers([_job("elsewhere", "b")]) == {1: "run.x"}
    plain = Record(service="vllm", phase=Phase.RUNNING, handle={"kind": "process", "pid": 7})
    assert recorded_servers([plain], ("h", "b")) == {7: "vllm"}
    assert recorded_servers([_job("elsewhere", "b")], ("h", "b")) == {}
