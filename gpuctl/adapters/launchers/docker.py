"""The ``docker`` launcher: one container per service, through the Docker Engine API.

The container is named ``gpuctl-<service>`` and labelled so that ``docker ps`` tells ours
from the rest, and so that a changed configuration is noticed::

    docker ps -a --filter label=gpuctl.managed=true \\
        --format '{{.Names}} {{.Status}} {{.Label "gpuctl.config-hash"}}'

``start`` is the equivalent of (gpuctl never pulls: the image must be on that host)::

    docker create --name gpuctl-vllm --label gpuctl.managed=true ... --gpus all \\
        --init --restart no IMAGE COMMAND && docker start gpuctl-vllm

A stopped container whose launch configuration is unchanged is started again (its
file system, e.g. a compile cache, survives); a changed one is removed and recreated.

``docker`` is imported lazily (it costs 120-360 ms, DESIGN §9 / STYLE 2), and every
library exception becomes a ``LauncherError`` (or ``StartFailed``) with a hint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shlex
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from gpuctl.adapters.launchers.base import Handle
from gpuctl.config import ServiceConfig
from gpuctl.core.units import parse_size_mib
from gpuctl.errors import GpuctlError, LauncherError, StartFailed

LABEL_MANAGED = "gpuctl.managed"
LABEL_SERVICE = "gpuctl.service"
LABEL_HASH = "gpuctl.config-hash"
DEFAULT_URL = "unix:///var/run/docker.sock"

# The init process Docker injects with ``init=True``; the server is its only child.
_INIT_NAMES = ("docker-init", "tini", "tini-static")
_GPU_ERROR = "could not select device driver"


def container_name(service: ServiceConfig) -> str:
    """``gpuctl-<service>``: one container per service, found again by this name."""
    return f"gpuctl-{service.name}"


def config_hash(service: ServiceConfig) -> str:
    """SHA-256 of the canonical JSON of what shapes the container (not timeouts, not priority).

    A stopped container with the same hash is started again; another hash means it is
    removed and recreated.
    """
    launch = {
        "image": service.image,
        "command": service.command,
        "env": dict(service.env),
        "volumes": list(service.volumes),
        "ports": dict(service.ports),
        "network": service.network,
        "ipc_mode": service.ipc_mode,
        "shm_size": service.shm_size,
        "gpus": service.gpus,
        "pid_mode": service.pid_mode,
    }
    canonical = json.dumps(launch, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


class DockerLauncher:
    """Start, find, check and stop a service's container on one Docker Engine.

    Args:
        base_url: the engine (``unix:///var/run/docker.sock``, ``ssh://me@gpu-box``,
            ``tcp://h:2376``); None uses the environment (``DOCKER_HOST``, and
            ``DOCKER_TLS_VERIFY``/``DOCKER_CERT_PATH`` in either case).
        timeout_s: the HTTP timeout of each API call (``stop`` adds its grace time).
    """

    kind = "docker"

    def __init__(self, base_url: str | None = None, timeout_s: float = 30.0) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self._client_obj: Any = None

    @property
    def url(self) -> str:
        """The engine's URL as users know it, for messages."""
        return self.base_url or os.environ.get("DOCKER_HOST") or DEFAULT_URL

    @property
    def is_local(self) -> bool:
        """Whether the engine runs on this machine, so its pids are ours to read."""
        return urlparse(self.url).scheme in ("unix", "npipe")

    # ------------------------------------------------------------------ connection

    @property
    def client(self) -> Any:
        """The ``docker.DockerClient``, connected on first use (it asks ``/version`` then)."""
        if self._client_obj is None:
            with self._errors():
                self._check_unix_socket()
                import docker

                env = dict(os.environ)
                if self.base_url:
                    env["DOCKER_HOST"] = self.base_url
                # from_env, also for an explicit URL, so DOCKER_TLS_VERIFY/DOCKER_CERT_PATH apply.
                self._client_obj = docker.from_env(timeout=self.timeout_s, environment=env)
        return self._client_obj

    def _check_unix_socket(self) -> None:
        """Connect once to a unix socket ourselves: the errno says why it fails (missing,
        refused, permission), and docker-py leaks the socket of a failed connect."""
        u = urlparse(self.url)
        if u.scheme != "unix":
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(u.path)
        finally:
            sock.close()

    def close(self) -> None:
        """Close the connection pool (a later call reconnects)."""
        if self._client_obj is not None:
            with contextlib.suppress(Exception):
                self._client_obj.close()
            self._client_obj = None

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn any exception of docker / requests / paramiko into a LauncherError."""
        try:
            yield
        except GpuctlError:
            raise
        except Exception as err:
            if not _is_library_error(err):
                raise
            raise self._launcher_error(err) from err

    def _launcher_error(self, err: BaseException) -> LauncherError:
        url = self.url
        text = _chain_text(err)
        name = type(err).__name__
        host = urlparse(url).hostname or url
        if "Install paramiko" in text or (
            isinstance(err, ModuleNotFoundError) and "paramiko" in text
        ):
            return LauncherError(
                f"Docker over ssh:// needs paramiko ({url})",
                hint="pip install 'gpuctl[ssh]'",
            )
        if type(err).__module__.startswith("paramiko") or "SSHException" in name:
            port = urlparse(url).port
            keyscan = f"ssh-keyscan {f'-p {port} ' if port else ''}{host} >> ~/.ssh/known_hosts"
            if "known_hosts" in text:
                return LauncherError(
                    f"the ssh host key of {host} is unknown ({url})",
                    hint=f"check the key, then add it: {keyscan}",
                )
            return LauncherError(
                f"ssh to the Docker Engine at {url} failed: {_first_line(str(err))}",
                hint=f"check that 'ssh {host} docker version' works without a prompt",
            )
        if name == "TLSParameterError":
            return LauncherError(
                f"bad TLS settings for the Docker Engine at {url}: {_first_line(str(err))}",
                hint="check DOCKER_CERT_PATH (ca.pem, cert.pem, key.pem) and DOCKER_TLS_VERIFY",
            )
        if "SSLError" in text or "CERTIFICATE_VERIFY_FAILED" in text:
            return LauncherError(
                f"TLS handshake with the Docker Engine at {url} failed",
                hint="check DOCKER_CERT_PATH and that the engine's certificate names this host",
            )
        status = getattr(err, "status_code", None)
        if status is not None:
            explanation = getattr(err, "explanation", None) or str(err)
            return LauncherError(
                f"the Docker Engine at {url} answered {status}: {_first_line(str(explanation))}",
                hint="see the engine's log (journalctl -u docker) for details",
            )
        if "Permission denied" in text or "PermissionError" in text:
            sock = url.removeprefix("unix://")
            return LauncherError(
                f"permission denied on the Docker Engine socket {sock}",
                hint="add yourself to the docker group (sudo usermod -aG docker $USER), "
                "then log in again",
            )
        if "Timeout" in name or "timed out" in text.lower():
            return LauncherError(
                f"the Docker Engine at {url} did not answer within {self.timeout_s:g} s",
                hint="is the engine (or the host) overloaded? check 'docker version' there",
            )
        if any(s in text for s in _UNREACHABLE):
            return LauncherError(
                f"cannot reach the Docker Engine at {url}: is dockerd running?",
                hint="start it (sudo systemctl start docker), or point hosts.<name>.docker "
                "/ DOCKER_HOST at a running engine",
            )
        return LauncherError(
            f"Docker Engine at {url}: {_first_line(str(err)) or name}",
            hint="check 'docker version' against the same engine",
        )

    # ------------------------------------------------------------------ configuration

    def inspect_config(self, service: ServiceConfig) -> dict[str, Any]:
        """The keyword arguments ``start`` gives ``containers.create`` (no engine needed).

        Raises:
            StartFailed: a volume, port or size in the service's config cannot be used.
        """
        from docker.types import DeviceRequest

        where = f"services.{service.name}"
        if not service.image:
            raise StartFailed(
                f"{where}.image: missing", hint="the docker launcher needs an image to run"
            )
        kwargs: dict[str, Any] = {
            "image": service.image,
            "command": shlex.split(service.command) if service.command else None,
            "name": container_name(service),
            "labels": {
                LABEL_MANAGED: "true",
                LABEL_SERVICE: service.name,
                LABEL_HASH: config_hash(service),
            },
            "environment": dict(service.env),
            "volumes": [_volume(where, v) for v in service.volumes],
            "ports": {_port_key(where, k): int(v) for k, v in service.ports.items()},
            "init": True,
            "restart_policy": {"Name": "no"},
        }
        if service.gpus:
            # == docker run --gpus all
            kwargs["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
        if service.network:
            kwargs["network_mode"] = service.network
        if service.ipc_mode:
            kwargs["ipc_mode"] = service.ipc_mode
        if service.pid_mode:
            kwargs["pid_mode"] = service.pid_mode
        if service.shm_size:
            kwargs["shm_size"] = _shm_bytes(where, service.shm_size)
        return kwargs

    # ------------------------------------------------------------------ Launcher

    def start(self, service: ServiceConfig) -> Handle:
        """Run the service's container, or reuse it; return once it is started.

        A running container is returned as it is (never a second one); a stopped one with
        the same configuration hash is started again; a stopped one with another hash, or
        one left ``created`` by a failed start, is removed and recreated.

        Raises:
            StartFailed: the engine refused to create or start it (no NVIDIA runtime,
                missing image, bad mount ...); nothing is left behind.
            LauncherError: the engine cannot be reached.
        """
        kwargs = self.inspect_config(service)
        name = kwargs["name"]
        want = kwargs["labels"][LABEL_HASH]
        with self._errors():
            ct = self._get(name)
            if ct is not None:
                self._check_ours(ct, service)
                status = ct.status
                if status in ("running", "restarting"):
                    return self._handle(ct)
                if status == "paused":
                    ct.unpause()
                    ct.reload()
                    return self._handle(ct)
                if status == "exited" and ct.labels.get(LABEL_HASH) == want:
                    self._start_existing(ct, service)
                    return self._handle(ct)
                # created (a failed start), dead, removing, or another configuration.
                self._remove(ct)
            ct = self._create(service, kwargs)
            self._start_existing(ct, service)
            return self._handle(ct)

    def find(self, service: ServiceConfig) -> Handle | None:
        """The handle of the service's running container, or None when it does not run.

        Raises:
            LauncherError: the engine cannot be reached.
        """
        with self._errors():
            ct = self._get(container_name(service))
            if ct is None or ct.labels.get(LABEL_MANAGED) != "true":
                return None
            if ct.status not in ("running", "restarting", "paused"):
                return None
            return self._handle(ct)

    def alive(self, handle: Handle) -> bool | None:
        """True while the container runs; False once exited, dead or gone; None when the
        engine cannot be asked."""
        try:
            with self._errors():
                ct = self._by_handle(handle)
                if ct is None:
                    return False
                return bool(ct.status in ("running", "restarting", "paused"))
        except LauncherError:
            return None

    def stop(self, handle: Handle, grace_s: float) -> None:
        """``docker stop -t grace``: SIGTERM, SIGKILL after ``grace_s``. Keeps the container
        (a later start with the same config reuses it). A missing container is fine.

        Raises:
            LauncherError: the engine cannot be reached or refused.
        """
        with self._errors():
            ct = self._by_handle(handle)
            if ct is None or ct.status in ("exited", "dead", "created"):
                return
            if ct.status == "paused":
                ct.unpause()
            ct.stop(timeout=max(0, math.ceil(grace_s)))  # whole seconds, never shorter

    def log_tail(self, handle: Handle, lines: int = 20) -> str:
        """The last ``lines`` of the container's stdout and stderr ('' when it is gone).

        Raises:
            LauncherError: the engine cannot be reached.
        """
        with self._errors():
            ct = self._by_handle(handle)
            if ct is None:
                return ""
            raw = ct.logs(tail=max(0, lines), stdout=True, stderr=True)
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
        return text.rstrip("\n")

    # ------------------------------------------------------------------ helpers

    def _get(self, ref: str) -> Any:
        import docker.errors

        try:
            return self.client.containers.get(ref)
        except docker.errors.NotFound:
            return None

    def _by_handle(self, handle: Handle) -> Any:
        # The id first: a container recreated under the same name is another server.
        if handle.container_id:
            return self._get(handle.container_id)
        if handle.container_name:
            return self._get(handle.container_name)
        return None

    def _check_ours(self, ct: Any, service: ServiceConfig) -> None:
        if ct.labels.get(LABEL_MANAGED) != "true":
            raise StartFailed(
                f"a container named {ct.name} exists on {self.url} that gpuctl did not create",
                hint=f"remove or rename it (docker rm -f {ct.name}), "
                f"then start {service.name} again",
            )

    def _remove(self, ct: Any) -> None:
        import docker.errors

        try:
            ct.remove(force=True)
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as err:
            if err.status_code != 409:  # 409: a removal is already in progress
                raise
        # A removal in progress (status "removing") ends shortly; the name is free then.
        deadline = time.monotonic() + 10.0
        while self._get(ct.name) is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    def _create(self, service: ServiceConfig, kwargs: dict[str, Any]) -> Any:
        import docker.errors

        args = dict(kwargs)
        image = args.pop("image")
        command = args.pop("command")
        try:
            # create, not run: run() pulls a missing image, and gpuctl never pulls.
            return self.client.containers.create(image, command, **args)
        except docker.errors.ImageNotFound:
            raise StartFailed(
                f"image {image} is not on the Docker Engine at {self.url}",
                hint=f"docker pull {image} on that host (gpuctl does not pull)",
            ) from None
        except docker.errors.APIError as err:
            if err.status_code == 409:
                raise StartFailed(
                    f"container {kwargs['name']} appeared while {service.name} was starting",
                    hint="another start raced this one; run the command again",
                ) from None
            if err.is_server_error() and not err.explanation:
                raise
            raise self._start_failed(service, err) from None

    def _start_existing(self, ct: Any, service: ServiceConfig) -> None:
        import docker.errors

        try:
            ct.start()
        except docker.errors.APIError as err:
            # A failed start leaves the container "created": remove it, or the next
            # attempt trips over its name.
            with contextlib.suppress(Exception):
                self._remove(ct)
            raise self._start_failed(service, err) from None
        ct.reload()

    def _start_failed(self, service: ServiceConfig, err: Any) -> StartFailed:
        explanation = _first_line(str(getattr(err, "explanation", None) or err))
        name = service.name
        if _GPU_ERROR in explanation:
            return StartFailed(
                f"the Docker Engine at {self.url} has no NVIDIA runtime "
                "(could not select device driver for GPUs)",
                hint="install nvidia-container-toolkit on that host, "
                f"or set services.{name}.gpus = false",
            )
        if "No such image" in explanation:
            return StartFailed(
                f"image {service.image} is not on the Docker Engine at {self.url}",
                hint=f"docker pull {service.image} on that host (gpuctl does not pull)",
            )
        if "port is already allocated" in explanation or "address already in use" in explanation:
            hint = f"another process holds the port; change services.{name}.ports or free it"
        elif "bind source path does not exist" in explanation or "invalid mount" in explanation:
            hint = f"create the path on that host or fix services.{name}.volumes"
        elif "executable file not found" in explanation or "no such file" in explanation:
            hint = f"check services.{name}.command against what the image contains"
        else:
            hint = f"check services.{name} (image, command, volumes, ports) on that host"
        return StartFailed(
            f"the Docker Engine at {self.url} could not start {container_name(service)}: "
            f"{explanation}",
            hint=hint,
        )

    def _handle(self, ct: Any) -> Handle:
        state = ct.attrs.get("State") or {}
        pid = _server_pid(ct, int(state.get("Pid") or 0), local=self.is_local)
        started: float | None = None
        if pid and self.is_local:
            from gpuctl.adapters import procinfo

            started = procinfo.start_time(pid)
        return Handle(
            kind=self.kind,
            pid=pid or None,
            pid_start=started,
            container_id=ct.id,
            container_name=ct.name,
        )


_UNREACHABLE = (
    "FileNotFoundError",
    "No such file or directory",
    "Connection refused",
    "ConnectionRefusedError",
    "NewConnectionError",
    "Connection aborted",
    "Name or service not known",
    "nodename nor servname",
    "No route to host",
    "Network is unreachable",
)


def _server_pid(ct: Any, init_pid: int, *, local: bool) -> int:
    """The host pid of the server: the only child of Docker's init, else ``State.Pid``.

    With ``init=True`` and a private PID namespace, ``State.Pid`` is ``docker-init``, not
    the server; the server is what the GPU probe reports and what ``match`` keywords see.
    With ``pid_mode = "host"`` Docker adds no init, and ``State.Pid`` is the server.
    """
    if init_pid <= 0:
        return 0
    deadline = time.monotonic() + 1.0
    while True:
        child = _init_child(ct, init_pid, local=local)
        if child is not None:
            return child or init_pid
        if time.monotonic() >= deadline:
            return init_pid
        time.sleep(0.02)  # the init forks its child right after it starts


def _init_child(ct: Any, init_pid: int, *, local: bool) -> int | None:
    """The init's single child; 0 when ``init_pid`` is no init or cannot be read; None when
    the init has no child yet."""
    kids: list[int]
    if local:
        import psutil

        try:
            proc = psutil.Process(init_pid)
            if proc.name() not in _INIT_NAMES:
                return 0
            kids = [c.pid for c in proc.children()]
        except (psutil.Error, OSError):
            return 0
    else:
        # A remote engine: ask it (``docker top``; the engine runs ps on its host).
        try:
            top = ct.top()
            titles = [t.upper() for t in top["Titles"]]
            i_pid, i_ppid, i_cmd = titles.index("PID"), titles.index("PPID"), titles.index("CMD")
            rows = top["Processes"] or []
            init = [r for r in rows if r[i_pid] == str(init_pid)]
            if not init or not any(n in init[0][i_cmd] for n in _INIT_NAMES):
                return 0
            kids = [int(r[i_pid]) for r in rows if r[i_ppid] == str(init_pid)]
        except Exception:
            return 0
    if len(kids) == 1:
        return kids[0]
    return None if not kids else 0


def _volume(where: str, spec: str) -> str:
    """Check ``host:container[:ro|rw]`` (the host side may be a named volume)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/"):
        raise StartFailed(
            f"{where}.volumes: expected 'host:container[:ro]', got {spec!r}",
            hint="e.g. '/data/hf:/root/.cache/huggingface:ro'",
        )
    return spec


def _port_key(where: str, key: str) -> str:
    """``8000`` / ``8000/tcp`` / ``8000/udp`` -> the SDK's ``8000/tcp`` form."""
    port, _, proto = key.partition("/")
    proto = proto or "tcp"
    if not port.isdigit() or not 0 < int(port) < 65536 or proto not in ("tcp", "udp", "sctp"):
        raise StartFailed(
            f"{where}.ports: expected a container port like '8000' or '8000/tcp', got {key!r}",
            hint='e.g. ports = { "8000" = 8000 } (container port = host port)',
        )
    return f"{int(port)}/{proto}"


def _shm_bytes(where: str, text: str) -> int:
    """gpuctl's sizes (``16GiB``, ``2g``; a bare number is MiB) in bytes, as Docker wants."""
    try:
        return parse_size_mib(text) * 1024 * 1024
    except ValueError as err:
        raise StartFailed(f"{where}.shm_size: {err}") from None


def _is_library_error(err: BaseException) -> bool:
    module = type(err).__module__.split(".")[0]
    if module in ("docker", "requests", "urllib3", "paramiko"):
        return True
    return isinstance(err, OSError | ModuleNotFoundError)


def _chain_text(err: BaseException) -> str:
    """Every message and class name in the exception's chain (causes and args)."""
    seen: set[int] = set()
    parts: list[str] = []

    def walk(e: object, depth: int) -> None:
        if depth > 8 or id(e) in seen:
            return
        seen.add(id(e))
        if isinstance(e, BaseException):
            parts.append(f"{type(e).__name__}: {e}")
            for arg in e.args:
                walk(arg, depth + 1)
            walk(e.__cause__, depth + 1)
            walk(e.__context__, depth + 1)

    walk(err, 0)
    return " | ".join(parts)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
