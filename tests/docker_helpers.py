"""Docker test helpers: a test image built locally, and services that run gpuctl in it.

No registry is reachable in CI, so the image is made with ``docker import`` from a tiny
root file system built here in memory: empty mount points, ``/etc/passwd``, and the
host's top-level ``/usr`` symlinks (merged-usr). Everything that runs comes from the host
through read-only bind mounts at the same paths: ``/usr`` (libc, libssl, ...), the Python
installation, the venv and the repository. So the container runs this checkout's gpuctl
with this interpreter, and nothing needs to be installed in the image.

The services use the host's network and PID namespace: the fake model server listens on
a host port, and the claims it writes in the (read-write) sim directory carry host pids
that the sim probe on the host can check, as the NVML probe sees a real container.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import socket
import sys
import tarfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import docker
import docker.errors

import gpuctl
from gpuctl.config import ServiceConfig

TEST_IMAGE = "gpuctl-test-base:latest"
# Bump when the root file system below changes: an older image of that tag is rebuilt.
IMAGE_VERSION = "2"
IMAGE_LABEL = "gpuctl.test-image"

_built: set[str] = set()

_ETC_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
_ETC_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def docker_client(timeout: float = 10.0) -> Any:
    """A ``docker.DockerClient`` for ``$DOCKER_HOST`` (or the default socket)."""
    return docker.from_env(timeout=timeout)


def docker_unavailable() -> str | None:
    """Why the docker tests cannot run here, or None when an engine answers."""
    if os.environ.get("GPUCTL_NO_DOCKER") == "1":
        return "GPUCTL_NO_DOCKER=1: scripts/ensure-dockerd found no Docker Engine"
    if sys.platform != "linux":
        return "the docker tests bind-mount this machine's Python: Linux only"
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    hint = "source scripts/ensure-dockerd to start a private one"
    if where.startswith("unix://"):
        # Connect ourselves first: docker-py leaks the socket of a failed connect, and
        # the suite turns that ResourceWarning into an error.
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5.0)
                s.connect(where.removeprefix("unix://"))
        except OSError as err:
            return f"no Docker Engine answers at {where} ({err.strerror or err}); {hint}"
    try:
        client = docker_client(timeout=5.0)
        try:
            client.ping()
            engine_host = client.info().get("Name")
        finally:
            client.close()
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"no Docker Engine answers at {where} ({first[:160]}); {hint}"
    if not where.startswith("unix://") and engine_host != socket.gethostname():
        return f"the Docker Engine at {where} runs on {engine_host}, not here (host mounts)"
    return None


# --------------------------------------------------------------------------- the image


def _top_level_links() -> dict[str, str]:
    """The host's merged-usr links (``/lib -> usr/lib``), copied into the image."""
    links = {}
    # Not sbin: Docker bind-mounts its init at /sbin/docker-init, which must not land
    # inside the read-only /usr mount.
    for name in ("bin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/", name)
        if path.is_symlink():
            links[name] = os.readlink(path)
    return links


def rootfs_tar() -> bytes:
    """A root file system of empty directories, two /etc files and the host's /usr links."""
    buf = io.BytesIO()
    now = int(time.time())
    links = _top_level_links()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = mode
            info.mtime = now
            tar.addfile(info)

        def add_file(name: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = now
            tar.addfile(info, io.BytesIO(data))

        for d in ("usr", "etc", "proc", "sys", "dev", "root", "run", "var", "work", "opt"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        add_dir("sbin")
        for d in ("bin", "lib", "lib64"):
            if d not in links:
                add_dir(d)
        for name, target in links.items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            info.mtime = now
            tar.addfile(info)
        add_file("etc/passwd", _ETC_PASSWD)
        add_file("etc/group", _ETC_GROUP)
    return buf.getvalue()


def ensure_test_image(client: Any) -> str:
    """Build ``gpuctl-test-base:latest`` once per session (kept when already current)."""
    if TEST_IMAGE in _built:
        return TEST_IMAGE
    try:
        image = client.images.get(TEST_IMAGE)
        current = (image.labels or {}).get(IMAGE_LABEL) == IMAGE_VERSION
    except docker.errors.ImageNotFound:
        current = False
    if not current:
        repo, _, tag = TEST_IMAGE.partition(":")
        client.api.import_image_from_data(
            rootfs_tar(),
            repository=repo,
            tag=tag,
            changes=[
                f"LABEL {IMAGE_LABEL}={IMAGE_VERSION}",
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                'CMD ["/bin/sh"]',
            ],
        )
        client.images.get(TEST_IMAGE)  # raises if the import did not produce it
    _built.add(TEST_IMAGE)
    return TEST_IMAGE


# --------------------------------------------------------------------------- services


def _repo_root() -> Path:
    return Path(gpuctl.__file__).resolve().parent.parent


def host_mounts(sim_dir: Path | None = None) -> tuple[str, ...]:
    """Read-only binds of what Python and gpuctl need; the sim dir read-write."""
    ro: list[Path] = [Path("/usr")]
    # A host without merged-usr keeps its libraries in real /lib*, /bin directories.
    for name in ("bin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/", name)
        if path.is_dir() and not path.is_symlink():
            ro.append(path)
    ro += [Path(sys.base_prefix).resolve(), Path(sys.prefix), _repo_root()]
    # The dynamic loader's cache: without it, libraries outside the default paths are missed.
    files = [p for p in (Path("/etc/ld.so.cache"),) if p.is_file()]
    mounts: list[str] = []
    for path in sorted(set(ro), key=lambda p: len(p.parts)):
        if not path.exists() or any(path.is_relative_to(Path(m.split(":")[0])) for m in mounts):
            continue
        mounts.append(f"{path}:{path}:ro")
    mounts += [f"{p}:{p}:ro" for p in files]
    if sim_dir is not None:
        mounts.append(f"{sim_dir}:{sim_dir}")
    return tuple(mounts)


def python_command(*args: str) -> str:
    """A command line running this interpreter (the venv's) with ``args``."""
    return shlex.join([sys.executable, *args])


def model_server_command(
    port: int, name: str = "vllm", memory: str = "20GiB", load_time: str = "2s"
) -> str:
    """``python -m gpuctl sim model-server ...`` on ``port`` (all interfaces: host network)."""
    return python_command(
        "-m", "gpuctl", "sim", "model-server", "--name", name, "--memory", memory,
        "--load-time", load_time, "--port", str(port),
    )  # fmt: skip


def unique_name(prefix: str = "t") -> str:
    """A service name no other test (or concurrent test run on the same engine) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def sim_service(
    name: str,
    command: str,
    *,
    sim_dir: Path,
    env: Mapping[str, str] | None = None,
    gpus: bool = False,
    image: str = TEST_IMAGE,
    ports: Mapping[str, int] | None = None,
    network: str | None = "host",
    pid_mode: str | None = "host",
    stop_timeout_s: float = 10.0,
) -> ServiceConfig:
    """A docker service running ``command`` in the test image on the simulated GPU.

    ``gpus`` defaults to False: the test engine has no NVIDIA runtime.
    """
    full_env = {
        "GPUCTL_SIM_DIR": str(sim_dir),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "HOME": "/root",
        "PATH": f"{Path(sys.prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        **(env or {}),
    }
    return ServiceConfig(
        name=name,
        host="local",
        launcher="docker",
        image=image,
        command=command,
        env=full_env,
        volumes=host_mounts(sim_dir),
        ports=dict(ports or {}),
        network=network,
        pid_mode=pid_mode,
        gpus=gpus,
        stop_timeout_s=stop_timeout_s,
    )


def remove_service_containers(client: Any, names: list[str]) -> None:
    """Force-remove every container of these services (by label), ignoring errors."""
    for name in names:
        try:
            found = client.containers.list(all=True, filters={"label": f"gpuctl.service={name}"})
        except Exception:
            continue
        for ct in found:
            with contextlib.suppress(Exception):
                ct.remove(force=True)


def wait_for(check: Callable[[], Any], timeout_s: float, step_s: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy; that value, or the last one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step_s)
