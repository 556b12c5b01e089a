"""The lifecycle of a service's container: start (or reuse), find, check, stop, log tail."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

from gpuctl import failpoints
from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.docker.errors import start_failed, translated
from gpuctl.adapters.launchers.docker.pids import server_pid
from gpuctl.adapters.launchers.docker.spec import (
    LABEL_HASH,
    LABEL_MANAGED,
    LABEL_PROOF,
    LABEL_SERVICE,
    container_name,
    create_kwargs,
)
from gpuctl.adapters.launchers.environ import UNPROVEN_HINT, new_start_nonce, server_env
from gpuctl.adapters.proof import MIN_NONCE_LEN
from gpuctl.config import ServiceConfig
from gpuctl.errors import LauncherError, StartFailed, Unproven

DEFAULT_URL = "unix:///var/run/docker.sock"
_RUNNING = ("running", "restarting", "paused")


class DockerLauncher:
    """Start, find, check and stop a service's container on one Docker Engine.

    Args:
        base_url: the engine (``unix:///var/run/docker.sock``, ``ssh://me@gpu-box``,
            ``tcp://h:2376``); None uses the environment (``DOCKER_HOST``, and
            ``DOCKER_TLS_VERIFY``/``DOCKER_CERT_PATH`` in either case).
        timeout_s: the HTTP timeout of each API call (``stop`` adds its grace time).
        secrets: environment variable names a container must not get unless the
            service's ``env`` sets them (a container never inherits the caller's
            environment anyway; the names only matter there).
    """

    kind = "docker"

    def __init__(
        self, base_url: str | None = None, timeout_s: float = 30.0, secrets: Iterable[str] = ()
    ) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.secrets = frozenset(secrets)
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

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return translated(self.url, self.timeout_s)

    # ------------------------------------------------------------------ configuration

    def inspect_config(
        self, service: ServiceConfig, start_nonce: str | None = None
    ) -> dict[str, Any]:
        """The keyword arguments ``start`` gives ``containers.create`` (no engine needed).

        Raises:
            StartFailed: a volume, port or size in the service's config cannot be used.
        """
        env = server_env(service, {}, self.secrets, start_nonce)
        return create_kwargs(service, env, start_nonce or "")

    # ------------------------------------------------------------------ Launcher

    def start(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle:
        """Run the service's container, or reuse it; return once it is started.

        A running container is returned as it is (never a second one); a stopped one with
        the same configuration hash is started again; a stopped one with another hash, or
        one left ``created`` by a failed start, is removed and recreated. A container
        started again keeps the environment it was created with (Docker cannot change
        it), so its ``GPUCTL_START_NONCE`` is its creation's: until the caller records
        it, such a start is found by its container name, not by the nonce.

        Raises:
            StartFailed: the engine refused to create or start it (no NVIDIA runtime,
                missing image, bad mount ...); nothing is left behind.
            LauncherError: the engine cannot be reached.
        """
        # Every created container carries a proof label: it is what a stop checks.
        kwargs = self.inspect_config(service, start_nonce or new_start_nonce())
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

    def find(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle | None:
        """The handle of the service's running container, or None when it does not run.

        The name finds it, whatever the nonce (see ``start``).

        Raises:
            LauncherError: the engine cannot be reached.
        """
        with self._errors():
            ct = self._get(container_name(service))
            if ct is None or ct.labels.get(LABEL_MANAGED) != "true":
                return None
            if ct.status not in _RUNNING:
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
                return bool(ct.status in _RUNNING)
        except LauncherError:
            return None

    def stop(self, handle: Handle, grace_s: float, service: str | None = None) -> None:
        """``docker stop -t grace``: SIGTERM, SIGKILL after ``grace_s``. Keeps the container
        (a later start with the same config reuses it). A missing container is fine.

        Only a container gpuctl created whose ``gpuctl.proof`` label is the handle's
        proof: the record can name any container on the engine.

        Raises:
            Unproven: the container lacks the label (another's, or made before gpuctl
                set it); nothing was stopped.
            LauncherError: the engine cannot be reached or refused.
        """
        with self._errors():
            ct = self._by_handle(handle)
            if ct is None or ct.status in ("exited", "dead", "created"):
                return
            labels = ct.labels or {}
            proof = handle.proof
            ok = isinstance(proof, str) and len(proof) >= MIN_NONCE_LEN
            # Its gpuctl.service label too: another service's record copied here carries
            # that container's proof.
            other = service is not None and labels.get(LABEL_SERVICE) != service
            if not ok or labels.get(LABEL_MANAGED) != "true" or labels.get(LABEL_PROOF) != proof:
                other = True
            if other:
                raise Unproven(
                    f"container {ct.name} on {self.url} is not known to be the server its "
                    f"record names (no {LABEL_PROOF} and {LABEL_SERVICE} labels matching "
                    "the record's)",
                    UNPROVEN_HINT.replace("stop it by hand", f"docker stop {ct.name} by hand"),
                )
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
            raise start_failed(service, self.url, err) from None

    def _start_existing(self, ct: Any, service: ServiceConfig) -> None:
        import docker.errors

        try:
            ct.start()
        except docker.errors.APIError as err:
            # A failed start leaves the container "created": remove it, or the next
            # attempt trips over its name.
            with contextlib.suppress(Exception):
                self._remove(ct)
            raise start_failed(service, self.url, err) from None
        # The container runs and nothing has told the caller yet: the window a test
        # kills the caller in.
        failpoints.hit("launch.spawned")
        ct.reload()

    def _handle(self, ct: Any) -> Handle:
        state = ct.attrs.get("State") or {}
        pid = server_pid(ct, int(state.get("Pid") or 0), local=self.is_local)
        started: float | None = None
        if pid and self.is_local:
            started = procinfo.start_time(pid)
        return Handle(
            kind=self.kind,
            pid=pid or None,
            pid_start=started,
            container_id=ct.id,
            container_name=ct.name,
            proof=(ct.labels or {}).get(LABEL_PROOF) or None,
        )
