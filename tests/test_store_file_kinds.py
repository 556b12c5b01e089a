"""Record-store files that are not regular files: a FIFO named ``records/x.json`` used to
block the agent's worker threads in ``open`` for ever (even after it was removed), and a
folder named ``zdir.json`` made ``/records`` answer 503 and its host UNKNOWN. Both are now
set aside and reported like any bad record, and nothing blocks. Real agent on loopback,
real files, the installed CLI."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuctl.adapters.store.direct import DirectStore
from gpuctl.sim.host import SimHost
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import cli_env, service_toml


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    with SimHost(root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h


def test_a_fifo_and_a_folder_among_the_records_are_set_aside_never_block(host: SimHost) -> None:
    records = host.state_dir / "records"
    records.mkdir(parents=True, exist_ok=True)
    os.mkfifo(records / "x.json")
    (records / "zdir.json").mkdir()
    auth = {"Authorization": f"Bearer {host.token}"}
    # More reads than the agent has worker threads: a blocked open would eat them all.
    for _ in range(12):
        r = httpx.get(f"{host.agent_url}/records", headers=auth, timeout=20)
        assert r.status_code == 200, r.text
    kept = {a["service"]: a for a in r.json()["set_aside"]}
    assert set(kept) == {"x", "zdir"}, kept
    assert "FIFO" in kept["x"]["why"] and "a folder" in kept["zdir"]["why"], kept
    assert not (records / "x.json").exists() or (records / "x.json").is_file()
    s = httpx.get(f"{host.agent_url}/status", params={"fresh": 1}, headers=auth, timeout=20)
    assert s.status_code == 200, s.text

    cfg = host.write_config(service_toml("zdir", 1, "sleep 60"))
    out = subprocess.run(
        [gpuctl_exe(), "locks", "--json"], env=cli_env(cfg), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "zdir.json.corrupt-" in out.stdout


def test_a_fifo_among_the_in_flight_entries_counts_for_nothing_and_never_blocks(
    tmp_path: Path,
) -> None:
    store = DirectStore(tmp_path / "state")
    folder = tmp_path / "state" / "inflight" / "svc"
    folder.mkdir(parents=True)
    os.mkfifo(folder / "e.json")
    got: list[dict[str, int]] = []
    t = threading.Thread(target=lambda: got.append(store.inflight()), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "inflight() blocked on a FIFO"
    assert got == [{}]
