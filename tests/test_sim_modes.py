"""The simulated GPU's folders and locks have explicit modes whatever the umask: under
umask 000 the sim directory and claims/ came out 0777 and sim.lock 0666 (anyone could
drop a claim or hold the lock). A real claiming process under umask 000."""

from __future__ import annotations

import stat
import subprocess
import sys
import textwrap
from pathlib import Path


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_sim_folders_and_locks_under_umask_000(tmp_path: Path) -> None:
    sim = tmp_path / "a" / "b" / "sim"
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        os.umask(0)
        from gpuctl.sim.gpu import SimGpu
        SimGpu(Path({str(sim)!r})).claim("x")
        print(os.getpid())
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stderr
    pid = r.stdout.strip()
    for folder in (tmp_path / "a", tmp_path / "a" / "b", sim, sim / "claims"):
        assert mode(folder) == 0o755, (folder, oct(mode(folder)))
    assert mode(sim / "sim.lock") == 0o644, oct(mode(sim / "sim.lock"))
    lock = sim / "claims" / f"{pid}.lock"
    if lock.exists():  # the claim's lock (the process has exited: it may be pruned)
        assert mode(lock) == 0o644, oct(mode(lock))
    for p in sim.rglob("*"):
        assert not mode(p) & 0o022, (p, oct(mode(p)))  # nothing writable by others
