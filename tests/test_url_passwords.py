"""A configured URL's password (``http://u:PW@host/…``) is never printed: gpuctl shows
it as ``u:***@`` in ``config show`` (text and JSON), in health reasons, in errors and in
every ``--json`` document. The installed CLI on a real config file."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpuctl.core.redact import mask_url_passwords, show_url
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import unique_name


def test_show_url() -> None:
    assert show_url("http://u:PW@h:1/m?x=1") == "http://u:***@h:1/m?x=1"
    assert show_url("http://TOKEN@h/m") == "http://***@h/m"
    assert show_url("http://h:1/m") == "http://h:1/m"
    assert (
        mask_url_passwords('{"a": "http://u:PW@h/x", "b": 1}')
        == '{"a": "http://u:***@h/x", "b": 1}'
    )


@pytest.mark.parametrize(
    "args",
    [
        ["config", "show"],
        ["config", "show", "--json"],
        ["config", "check"],
        ["status"],
        ["status", "--json"],
        ["ensure", "SVC", "--json", "--timeout", "2s"],
        ["stop", "SVC"],
    ],
    ids=lambda a: " ".join(a),
)
def test_no_command_prints_a_configured_password(tmp_path: Path, args: list[str]) -> None:
    name = unique_name("pw")
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[hosts.local]\nprobe = "sim"\nsim_dir = "{tmp_path / "sim"}"\n\n'
        f"[services.{name}]\n"
        'launcher = "process"\ncommand = "sleep 1"\n'
        'health = "http://alice:PWSECRET1@127.0.0.1:9/health"\n'
        'metrics = "http://bob:PWSECRET2@127.0.0.1:9/metrics"\n'
        f'match = ["{name}"]\nmemory = "1GiB"\nhealth_timeout = "1s"\n'
    )
    env = dict(os.environ, GPUCTL_CONFIG=str(cfg), GPUCTL_STATE_DIR=str(tmp_path / "state"))
    env.pop("GPUCTL_DEBUG", None)
    argv = [name if a == "SVC" else a for a in args]
    r = subprocess.run(
        [gpuctl_exe(), *argv], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    said = r.stdout + r.stderr
    assert "PWSECRET" not in said, said
    if args[:2] == ["config", "show"]:
        assert "alice:***@127.0.0.1" in said and "bob:***@127.0.0.1" in said, said
