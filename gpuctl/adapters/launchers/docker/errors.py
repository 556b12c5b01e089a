"""Every exception of docker / requests / urllib3 / paramiko becomes a ``LauncherError``
(or ``StartFailed``) with a one-line message and a hint naming the fix."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from gpuctl.adapters.launchers.docker.spec import container_name
from gpuctl.config import ServiceConfig
from gpuctl.errors import GpuctlError, LauncherError, StartFailed

_GPU_ERROR = "could not select device driver"

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


@contextlib.contextmanager
def translated(url: str, timeout_s: float) -> Iterator[None]:
    """Turn any exception of docker / requests / paramiko into a LauncherError."""
    try:
        yield
    except GpuctlError:
        raise
    except Exception as err:
        if not is_library_error(err):
            raise
        raise engine_error(err, url, timeout_s) from err


def engine_error(err: BaseException, url: str, timeout_s: float) -> LauncherError:
    """The engine, or the way to it, failed: say which part and how to fix it."""
    text = _chain_text(err)
    name = type(err).__name__
    host = urlparse(url).hostname or url
    if "Install paramiko" in text or (isinstance(err, ModuleNotFoundError) and "paramiko" in text):
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
            f"ssh to the Docker Engine at {url} failed: {first_line(str(err))}",
            hint=f"check that 'ssh {host} docker version' works without a prompt",
        )
    if name == "TLSParameterError":
        return LauncherError(
            f"bad TLS settings for the Docker Engine at {url}: {first_line(str(err))}",
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
            f"the Docker Engine at {url} answered {status}: {first_line(str(explanation))}",
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
            f"the Docker Engine at {url} did not answer within {timeout_s:g} s",
            hint="is the engine (or the host) overloaded? check 'docker version' there",
        )
    if any(s in text for s in _UNREACHABLE):
        return LauncherError(
            f"cannot reach the Docker Engine at {url}: is dockerd running?",
            hint="start it (sudo systemctl start docker), or point hosts.<name>.docker "
            "/ DOCKER_HOST at a running engine",
        )
    return LauncherError(
        f"Docker Engine at {url}: {first_line(str(err)) or name}",
        hint="check 'docker version' against the same engine",
    )


def start_failed(service: ServiceConfig, url: str, err: Any) -> StartFailed:
    """The engine refused to create or start the container: say what to change."""
    explanation = first_line(str(getattr(err, "explanation", None) or err))
    name = service.name
    if _GPU_ERROR in explanation:
        return StartFailed(
            f"the Docker Engine at {url} has no NVIDIA runtime "
            "(could not select device driver for GPUs)",
            hint="install nvidia-container-toolkit on that host, "
            f"or set services.{name}.gpus = false",
        )
    if "No such image" in explanation:
        return StartFailed(
            f"image {service.image} is not on the Docker Engine at {url}",
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
        f"the Docker Engine at {url} could not start {container_name(service)}: {explanation}",
        hint=hint,
    )


def is_library_error(err: BaseException) -> bool:
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


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
