"""``gpuctl config init``: a commented starter config that passes ``gpuctl config check``.

Two shapes: this machine has a GPU, so it is the host and is probed directly; or it has
none, so the GPU host runs ``gpuctl agent`` and this config points at it, with a token
file created here (mode 600) to copy to the agent.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from gpuctl.config.parse import HTTP
from gpuctl.config.secrets import write_secret_file
from gpuctl.config.table import check_url
from gpuctl.core.names import is_valid_name
from gpuctl.errors import ConfigError, UsageError

DEFAULT_AGENT_URL = "http://127.0.0.1:9400"

_HEADER = """\
# gpuctl configuration, written by `gpuctl config init`.
# Check it with `gpuctl config check`; every key is in docs/reference/configuration.md.

[defaults]
idle_timeout = "30m"        # an idle service may be stopped after this ("never" exempts it)
yield_after = "10m"         # unused this long, a server yields to any start that preempts
health_timeout = "10m"      # a vLLM cold start takes minutes; 120 s fails every one
# agent_timeout = "3s"      # how long status waits for an agent
"""

_LOCAL_HOST = """
# This machine has a GPU: it is the host, probed directly (no agent needed here).
[hosts.{name}]
probe = "auto"              # auto | nvml | nvidia-smi | sim
# gpu_memory = "128GiB"     # the total, where NVML cannot tell (unified memory, DGX Spark)
"""

_AGENT_HOST = """
# No GPU answers on this machine: the GPU host runs `gpuctl agent`, and gpuctl asks it.
# On the GPU host, with a copy of the token file:
#   gpuctl agent --listen 0.0.0.0:{port} --token-file {token_file}
[hosts.{name}]
agent = "{agent}"
# The token file sits beside this file, mode 600; never put a token itself in the config.
token_file = "{token_rel}"
# read_token_file = "{name}.read.token"  # read-only, for dashboards and scrapers
# jupyter = "http://HOST:8888"          # for launcher = "jupyter"
# docker = "ssh://me@HOST"              # for launcher = "docker"; any Docker Engine URL
# [hosts.{name}.slurm]                  # for launcher = "slurm": partition, account, time_limit, gpus
# gpu_memory = "128GiB"                 # the total, where NVML cannot tell (unified memory)
"""

_SERVICE = """
# A service gpuctl starts on demand. Uncomment and adapt:
# [services.vllm]
# hosts = ["dgx1", "dgx2"]  # a pool: ensure picks one (each needs an agent); default: the one host
# launcher = "process"      # docker | jupyter | process | ollama | slurm
# command = "vllm serve Qwen/Qwen3-32B --port 8000"
# health = "http://127.0.0.1:8000/health"
# match = ["vllm"]          # command keywords that mean "this is ours, loading"
# memory = "80GiB"          # its budget on the GPU
# priority = 100
# devices = [0]             # the GPUs it may use; leave out for any one GPU
"""


class Written(msgspec.Struct, frozen=True):
    """What ``write_starter`` did: the config file, and the token file it created (or kept)."""

    config: Path
    host: str
    agent: str | None
    token_file: Path | None
    token_created: bool


def default_host_name(gpu_here: bool) -> str:
    """This machine's short host name when it is the GPU host (``gpu`` when that name is not
    one the store accepts); ``gpu`` for a GPU behind an agent."""
    if gpu_here:
        short = socket.gethostname().split(".")[0]
        return short if is_valid_name(short) else "gpu"
    return "gpu"


def starter_text(host: str, *, gpu_here: bool, agent: str, token_file: Path) -> str:
    """The commented starter config (TOML)."""
    if gpu_here:
        body = _LOCAL_HOST.format(name=host)
    else:
        rel = token_file.name

        try:
            url = urlsplit(agent)
            port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:  # checked before; the comment is no place to fail
            port = 9400
        body = _AGENT_HOST.format(
            name=host,
            agent=agent,
            port=port,
            token_file=token_file,
            token_rel=rel,
        )
    return _HEADER + body + _SERVICE


def write_starter(
    path: Path, *, gpu_here: bool, agent: str | None, host: str | None, force: bool
) -> Written:
    """Write the starter config at ``path`` (creating its folder, mode 700), and for an
    agent host a token file beside it (mode 600, a fresh random token; an existing one is
    kept, never replaced).

    Raises:
        UsageError: ``path`` exists and ``force`` is off; a bad ``--agent`` or ``--host``.
        ConfigError: the token file's place is taken by something that is not a token file.
        OSError: the files cannot be written.
    """
    name = host or default_host_name(gpu_here)
    if not is_valid_name(name):
        raise UsageError(f"--host: {name!r} is not a name gpuctl accepts", hint="e.g. dgx")
    url = DEFAULT_AGENT_URL if agent is None else agent
    if not gpu_here:
        try:
            url = check_url("--agent", url.strip(), HTTP)
        except ConfigError as e:
            raise UsageError(e.message, hint="e.g. --agent http://100.64.0.10:9400") from None
    if path.exists() and not force:
        raise UsageError(
            f"{path} exists; gpuctl config init never writes over a config",
            hint="check it with `gpuctl config check`, or pass --force to replace it",
        )
    if path.is_dir():
        raise UsageError(f"{path} is a folder, not a config file")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token_file = path.parent / f"{name}.token"
    created = False
    if not gpu_here:
        if token_file.is_symlink() or (token_file.exists() and not token_file.is_file()):
            raise ConfigError(
                f"{token_file} exists and is not a plain file",
                hint="move it away, or pass --host with another name",
            )
        if not token_file.exists():
            write_secret_file(token_file, secrets.token_urlsafe(32))
            created = True
    text = starter_text(name, gpu_here=gpu_here, agent=url, token_file=token_file)
    _write_new(path, text, replace=force)
    return Written(
        config=path,
        host=name,
        agent=None if gpu_here else url,
        token_file=None if gpu_here else token_file,
        token_created=created,
    )


def _write_new(path: Path, text: str, *, replace: bool) -> None:
    """Write ``text`` at ``path`` whole or not at all: a temp file in the same folder,
    fsync, then a link that fails if the name is taken (or a replace, with ``--force``)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic, and refuses to replace: no race with a writer
            except FileExistsError:
                raise UsageError(
                    f"{path} exists; gpuctl config init never writes over a config",
                    hint="pass --force to replace it",
                ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
