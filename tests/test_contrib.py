"""The ops files in contrib/: the agent's systemd unit, reclaim's timer, service and cron
line, the sysusers.d and tmpfiles.d snippets.

Without systemd: the files are parsed and checked against each other and against the
real CLI (the agent starts with the unit's own command line). With systemd's tools:
``systemd-analyze verify`` and ``security --offline``, and ``systemd-sysusers`` /
``systemd-tmpfiles`` create the user and the shared state directory in a scratch root.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from gpuctl.cli.app import create_app
from gpuctl.sim.host import free_port
from tests.conftest import gpuctl_exe

ROOT = Path(__file__).resolve().parents[1]
CONTRIB = ROOT / "contrib"
UNITS = ("gpuctl-agent.service", "gpuctl-reclaim.service", "gpuctl-reclaim.timer")
STATE_DIR = "/var/lib/gpuctl"
INSTALLED = "/opt/gpuctl/.venv/bin/gpuctl"  # the units expect it here; the docs say edit


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file as {section: {key: [values in order]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    logical = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not logical and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        line, logical = logical + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} before any [section]"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not Key=Value"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section][key]
    return values[-1]  # systemd: the last assignment wins


def environment(unit: dict[str, dict[str, list[str]]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in unit["Service"].get("Environment", []):
        for item in shlex.split(value):
            k, _, v = item.partition("=")
            env[k] = v
    return env


def commands() -> set[str]:
    import typer.main

    return set(typer.main.get_command(create_app()).commands)  # type: ignore[attr-defined]


# ---- without systemd


def test_agent_unit_runs_a_dedicated_user_hardened() -> None:
    unit = parse_unit(CONTRIB / "gpuctl-agent.service")
    svc = unit["Service"]
    assert one(unit, "Service", "User") == "gpuctl"
    assert one(unit, "Service", "Group") == "gpuctl"
    assert one(unit, "Service", "NoNewPrivileges") == "yes"
    assert one(unit, "Service", "ProtectSystem") == "strict"
    assert one(unit, "Service", "PrivateTmp") == "yes"
    assert one(unit, "Service", "ProtectHome") in ("yes", "read-only", "tmpfs")
    assert one(unit, "Service", "CapabilityBoundingSet") == ""  # no capabilities at all
    assert STATE_DIR in svc["ReadWritePaths"][-1].split()
    # NVML needs /dev/nvidia*: a private /dev would make every reading UNKNOWN.
    assert svc.get("PrivateDevices", ["no"])[-1] == "no"
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_agent_unit_raises_the_descriptor_limit() -> None:
    """systemd's default soft limit (1024) is below what its connection bound needs:
    1,100 idle sockets took every descriptor of the agent (issue 17)."""
    from gpuctl.core.conn_limits import DEFAULT_MAX_TOTAL

    unit = parse_unit(CONTRIB / "gpuctl-agent.service")
    soft = one(unit, "Service", "LimitNOFILE").split(":")[0]
    assert soft.isdigit() and int(soft) > 2 * DEFAULT_MAX_TOTAL, soft


@pytest.mark.parametrize("name", ["gpuctl-agent.service", "gpuctl-reclaim.service"])
def test_state_dir_is_shared_through_the_gpuctl_group(name: str) -> None:
    """0770 + setgid, owned by gpuctl:gpuctl, files group-writable: agent, cron and people
    (members of the group) share one store."""
    unit = parse_unit(CONTRIB / name)
    dirs = one(unit, "Service", "StateDirectory").split()
    assert dirs[0] == "gpuctl"
    assert {"gpuctl/records", "gpuctl/locks", "gpuctl/logs"} <= set(dirs)
    mode = int(one(unit, "Service", "StateDirectoryMode"), 8)
    assert mode & stat.S_ISGID
    assert mode & 0o777 == 0o770
    assert int(one(unit, "Service", "UMask"), 8) & 0o070 == 0  # the group keeps rw
    assert environment(unit)["GPUCTL_STATE_DIR"] == STATE_DIR


def test_agent_unit_command_line_is_accepted_by_the_real_agent(tmp_path: Path) -> None:
    """The unit's ExecStart, with only its addresses and paths moved into tmp_path (and
    the sim probe: this machine has no GPU), starts a real agent that serves /status."""
    unit = parse_unit(CONTRIB / "gpuctl-agent.service")
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    assert argv[0] == INSTALLED and argv[1] == "agent"
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert opts["--state-dir"] == STATE_DIR
    assert opts["--token-file"].startswith("/etc/gpuctl/")
    assert opts["--listen"].endswith(":9400")
    assert opts["--probe"] == "auto"

    token = tmp_path / "agent.token"
    token.write_text("s3cret-token-for-the-test\n")
    token.chmod(0o600)
    port = free_port()
    moved = {
        **opts,
        "--listen": f"127.0.0.1:{port}",
        "--probe": "sim",
        "--token-file": str(token),
        "--state-dir": str(tmp_path / "state"),
    }
    cmd = [gpuctl_exe(), "agent", *[x for kv in moved.items() for x in kv]]
    cmd += ["--sim-dir", str(tmp_path / "sim")]
    (tmp_path / "sim").mkdir()  # named with --sim-dir, it must exist
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the agent did not come up"
            time.sleep(0.1)
        r = httpx.get(
            f"{url}/status", headers={"Authorization": "Bearer s3cret-token-for-the-test"}
        )
        assert r.status_code == 200
        assert r.json()["state_dir"] == str(tmp_path / "state")
        assert httpx.get(f"{url}/status").status_code == 401
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_reclaim_timer_and_service() -> None:
    timer = parse_unit(CONTRIB / "gpuctl-reclaim.timer")
    svc = parse_unit(CONTRIB / "gpuctl-reclaim.service")
    agent = parse_unit(CONTRIB / "gpuctl-agent.service")
    # The timer starts the service of its own name (no Unit= override), every 5 minutes.
    assert "Unit" not in timer["Timer"]
    assert one(timer, "Timer", "OnCalendar") == "*:0/5"
    assert one(timer, "Install", "WantedBy") == "timers.target"
    assert one(svc, "Service", "Type") == "oneshot"
    assert one(svc, "Service", "User") == "gpuctl"
    argv = shlex.split(one(svc, "Service", "ExecStart"))
    assert argv == [INSTALLED, "reclaim"]
    assert shlex.split(one(agent, "Service", "ExecStart"))[0] == argv[0]
    assert one(svc, "Service", "NoNewPrivileges") == "yes"
    assert one(svc, "Service", "ProtectSystem") == "strict"
    # Signalling a group member's server needs CAP_KILL, and it gets nothing more.
    assert one(svc, "Service", "CapabilityBoundingSet").split() == ["CAP_KILL"]
    assert environment(svc)["GPUCTL_CONFIG"] == "/etc/gpuctl/config.toml"


CRON_FIELDS = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]


def cron_field_ok(field: str, lo: int, hi: int) -> bool:
    for part in field.split(","):
        m = re.fullmatch(r"(\*|(\d+)(?:-(\d+))?)(?:/(\d+))?", part)
        if not m:
            return False
        nums = [int(g) for g in (m.group(2), m.group(3)) if g is not None]
        if any(not lo <= n <= hi for n in nums) or (m.group(4) and int(m.group(4)) == 0):
            return False
    return True


def test_cron_line() -> None:
    """/etc/cron.d format: five valid time fields, the user, the command; the same state
    dir and the same gpuctl as the units; and the personal-crontab line in its comment."""
    text = (CONTRIB / "gpuctl-reclaim.cron").read_text()
    env: dict[str, str] = {}
    jobs: list[list[str]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if re.fullmatch(r"[A-Z_]+=.*", line):
            k, _, v = line.partition("=")
            env[k] = v
            continue
        jobs.append(line.split(None, 6))
    assert len(jobs) == 1
    job = jobs[0]
    for field, (lo, hi) in zip(job[:5], CRON_FIELDS, strict=True):
        assert cron_field_ok(field, lo, hi), field
    assert job[:5] == ["*/5", "*", "*", "*", "*"]
    assert job[5] == "gpuctl"
    assert job[6] == "gpuctl reclaim"
    assert env["PATH"].split(":")[0] == str(Path(INSTALLED).parent)
    assert env["GPUCTL_STATE_DIR"] == STATE_DIR
    assert "#   */5 * * * * gpuctl reclaim" in text


def test_sysusers_and_tmpfiles_snippets() -> None:
    users = [
        ln.split()
        for ln in (CONTRIB / "gpuctl.sysusers").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert [u[:2] for u in users] == [["u", "gpuctl"]]
    dirs = [
        ln.split()
        for ln in (CONTRIB / "gpuctl.tmpfiles").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert dirs[0] == ["d", STATE_DIR, "2770", "gpuctl", "gpuctl", "-"]
    assert {d[1] for d in dirs} == {STATE_DIR} | {
        f"{STATE_DIR}/{s}" for s in ("records", "locks", "logs")
    }


def test_reclaim_files_run_a_real_command() -> None:
    if "reclaim" not in commands():
        pytest.skip("`gpuctl reclaim` has not landed yet: the timer and cron line wait for it")
    from typer.testing import CliRunner

    r = CliRunner().invoke(create_app(), ["reclaim", "--help"])
    assert r.exit_code == 0, r.output


# ---- with systemd's tools


def need(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        pytest.skip(f"{tool} is not installed (./scripts/test installs Debian's systemd as root)")
    return found


def units_for_this_machine(tmp_path: Path) -> list[Path]:
    """The units with ExecStart pointing at this gpuctl (verify checks it is executable)."""
    out = []
    for name in UNITS:
        text = (CONTRIB / name).read_text().replace(INSTALLED, gpuctl_exe())
        (tmp_path / name).write_text(text)
        out.append(tmp_path / name)
    return out


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = need("systemd-analyze")
    files = units_for_this_machine(tmp_path)
    r = subprocess.run(
        [tool, "verify", "--man=no", *[str(f) for f in files]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    # verify exits 0 on an unknown key or a bad value; it only warns. Any warning fails.
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


@pytest.mark.parametrize("name", ["gpuctl-agent.service", "gpuctl-reclaim.service"])
def test_systemd_security_exposure_is_ok(name: str, tmp_path: Path) -> None:
    """systemd's own hardening score, offline: "OK" (below 3.0 of 10; a unit with no
    hardening scores 9.6 "UNSAFE")."""
    tool = need("systemd-analyze")
    units_for_this_machine(tmp_path)
    r = subprocess.run(
        [tool, "security", "--offline=yes", "--no-pager", "--threshold=30", name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr


def test_sysusers_and_tmpfiles_create_the_shared_state_dir(tmp_path: Path) -> None:
    sysusers = need("systemd-sysusers")
    tmpfiles = need("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run(
        [sysusers, f"--root={root}", str(CONTRIB / "gpuctl.sysusers")],
        check=True,
        capture_output=True,
    )
    passwd = {
        ln.split(":")[0]: ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()
    }
    group = {
        ln.split(":")[0]: ln.split(":") for ln in (root / "etc/group").read_text().splitlines()
    }
    uid, gid = int(passwd["gpuctl"][2]), int(group["gpuctl"][2])
    assert passwd["gpuctl"][5] == STATE_DIR
    assert uid < 1000, "a system user"
    r = subprocess.run(
        [tmpfiles, "--create", f"--root={root}", str(CONTRIB / "gpuctl.tmpfiles")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    for sub in ("", "records", "locks", "logs"):
        st = (root / STATE_DIR.lstrip("/") / sub).stat()
        assert stat.S_IMODE(st.st_mode) == 0o2770, (sub, oct(st.st_mode))
        assert (st.st_uid, st.st_gid) == (uid, gid)
