"""The ``ollama`` launcher: a model loaded into (and unloaded from) an Ollama server.

Ollama runs as a daemon that gpuctl does not start; its models load on demand. So
"start" here is Ollama's own preload, and "stop" its unload::

    curl http://dgx:11434/api/generate -d '{"model": "qwen3:32b", "keep_alive": "30m"}'
    curl http://dgx:11434/api/ps
    curl http://dgx:11434/api/generate -d '{"model": "qwen3:32b", "keep_alive": 0}'

- **start** checks that Ollama has the model (``/api/tags``), then sends the empty
  generate request from a small detached process (``python -m
  gpuctl.adapters.launchers.ollama_loader``), so the load goes on when the caller is
  interrupted or runs ``ensure --no-wait``: Ollama drops a load whose client went away
  before it began. Its ``keep_alive`` is the service's ``idle_timeout`` (``-1`` for
  ``"never"``), so Ollama's own expiry agrees with ``gpuctl reclaim``.
- **health and memory** come from ``/api/ps``: the model is listed with its
  ``size_vram``. Ollama lists a model from the moment its load begins and holds the
  requests for it until it is loaded, so while our own load request runs, the model
  counts as loading, not ready.
- **stop** is ``keep_alive: 0``: Ollama unloads the model once the requests it serves
  are done; stop waits up to the service's ``stop_timeout`` for it to go.
- **In flight**: Ollama has no metric of requests in flight, so reclaim relies on the
  store's in-flight counts alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.environ import UNPROVEN_HINT
from gpuctl.adapters.launchers.logfile import open_log, tail_file
from gpuctl.core.decision import Health
from gpuctl.core.units import format_mib
from gpuctl.errors import LauncherError, StartFailed, Unproven

if TYPE_CHECKING:
    import httpx

    from gpuctl.config import ServiceConfig

KIND = "ollama"
# What the detached loader keeps of the caller's environment: enough to run Python,
# none of gpuctl's secrets.
_LOADER_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")


def normalize_model(name: str) -> str:
    """Ollama's model names: ``qwen3`` means ``qwen3:latest`` (as ``/api/ps`` lists it)."""
    name = name.strip()
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def keep_alive_for(idle_timeout_s: float | None) -> int:
    """The ``keep_alive`` a load asks for: the idle timeout in seconds, -1 for "never"."""
    if idle_timeout_s is None or not math.isfinite(idle_timeout_s):
        return -1
    return max(1, math.ceil(idle_timeout_s))


class LoadedModel(msgspec.Struct, frozen=True):
    """One row of ``/api/ps``."""

    name: str
    size_mib: int
    vram_mib: int
    expires_at: str


class OllamaLauncher:
    """One service's model on one Ollama server.

    Args:
        url: the host's ``ollama`` URL (``http://dgx:11434``).
        model: the service's ``model``.
        keep_alive_s: the service's idle timeout (None: never), sent with each load.
        log_dir: where the detached loader writes what went wrong.
        client: an httpx client to reuse (one per command); made here when None.
        timeout_s: for each request to Ollama (a load is the loader's, and not bounded).
    """

    kind = KIND

    def __init__(
        self,
        url: str,
        model: str,
        *,
        keep_alive_s: float | None = None,
        log_dir: Path | None = None,
        client: httpx.Client | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = normalize_model(model)
        self.keep_alive = keep_alive_for(keep_alive_s)
        self.log_dir = log_dir
        self.timeout_s = timeout_s
        self._client = client
        self._own_client = client is None
        self._loader: subprocess.Popen[bytes] | None = None

    # -- Ollama's API

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            import httpx

            self._client = httpx.Client(timeout=self.timeout_s)
        return self._client

    def _get(self, path: str) -> Any:
        import httpx

        try:
            r = self.client.get(self.url + path, timeout=self.timeout_s)
            r.raise_for_status()
            return r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise LauncherError(
                f"Ollama at {self.url} did not answer {path}: {_why(e)}",
                hint="is `ollama serve` running there? check the host's `ollama` URL",
            ) from None

    def ps(self) -> dict[str, LoadedModel]:
        """The models Ollama has loaded (or is loading), by name.

        Raises:
            LauncherError: Ollama does not answer, or answers nonsense.
        """
        data = self._get("/api/ps")
        models = data.get("models") if isinstance(data, dict) else None
        if not isinstance(models, list):
            raise LauncherError(f"Ollama at {self.url} answered /api/ps without a model list")
        out: dict[str, LoadedModel] = {}
        for m in models:
            if not isinstance(m, dict) or not isinstance(m.get("name"), str):
                continue
            out[m["name"]] = LoadedModel(
                name=m["name"],
                size_mib=_mib(m.get("size")),
                vram_mib=_mib(m.get("size_vram")),
                expires_at=str(m.get("expires_at") or ""),
            )
        return out

    def has_model(self) -> bool:
        """Whether Ollama has the model on disk (``/api/tags``)."""
        data = self._get("/api/tags")
        models = data.get("models") if isinstance(data, dict) else None
        names = {
            normalize_model(str(m.get("name") or m.get("model") or ""))
            for m in models or []
            if isinstance(m, dict)
        }
        return self.model in names

    def health(self) -> Health:
        """Ready when ``/api/ps`` lists the model and no load of ours is still running.

        Never raises: an Ollama that does not answer is ``refused``/``timeout``.
        """
        try:
            loaded = self.ps()
        except LauncherError as e:
            return _unreachable(e)
        found = loaded.get(self.model)
        if found is not None and self._loader is not None and self._loader.poll() is None:
            return Health(
                "refused",
                f"{self.model} is loading in Ollama ({_placed(found)})",
                memory_mib=found.vram_mib,
            )
        return _listed(self.url, self.model, found)

    # -- the Launcher protocol

    def start(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle:
        """Ask Ollama to load the model, from a detached loader; returns at once.

        The loader carries ``GPUCTL_START_NONCE``: it stands for the load under way, so
        a start whose caller died before recording it is still found (and counted).

        Raises:
            StartFailed: Ollama does not answer, or does not have the model.
        """
        try:
            present = self.has_model()
        except LauncherError as e:
            raise StartFailed(e.message, hint=e.hint) from None
        if not present:
            raise StartFailed(
                f"Ollama at {self.url} does not have the model {self.model}",
                hint=f"run `ollama pull {self.model}` on the host, or fix "
                f"services.{service.name}.model",
            )
        log = self._log_path(service)
        env = {k: v for k, v in os.environ.items() if k in _LOADER_ENV}
        if start_nonce:
            env["GPUCTL_START_NONCE"] = start_nonce
        argv = [
            sys.executable, "-m", "gpuctl.adapters.launchers.ollama_loader",
            self.url, self.model, str(self.keep_alive), str(service.health_timeout_s),
        ]  # fmt: skip
        root = self.log_dir.parent if self.log_dir else None
        try:
            out = open_log(log, service.name, root=root) if log else subprocess.DEVNULL
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # Ctrl-C of the caller does not end the load
                    close_fds=True,
                )
            finally:
                if out != subprocess.DEVNULL:
                    os.close(out)
        except OSError as e:
            raise StartFailed(f"cannot start the Ollama loader: {e.strerror or e}") from None
        self._loader = proc

        return Handle(
            kind=KIND,
            pid=proc.pid,
            pid_start=procinfo.start_time(proc.pid),
            log=str(log) if log else None,
            proof=self.model,
        )

    def alive(self, handle: Handle) -> bool | None:
        """True while Ollama lists the model, or our loader still runs; None: no answer."""
        try:
            if self.model in self.ps():
                return True
        except LauncherError:
            return None
        return self._loader_alive(handle)

    def stop(self, handle: Handle, grace_s: float, service: str | None = None) -> None:
        """Unload (``keep_alive: 0``) and wait up to ``grace_s`` for the model to go.

        ``service`` is unused: this launcher serves one service's model, its proof.

        Raises:
            LauncherError: Ollama does not answer, or still has the model after ``grace_s``
                (requests in flight hold it).
        """
        import httpx

        if handle.pid and self._loader_alive(handle):
            if handle.proof != self.model:  # only a handle a start of this model wrote
                raise Unproven(f"pid {handle.pid} is not the loader of {self.model}", UNPROVEN_HINT)
            # Our load is still running: ending it first keeps it from loading the model
            # again right after the unload.
            with contextlib.suppress(OSError):
                os.kill(handle.pid, signal.SIGTERM)
        try:
            r = self.client.post(
                self.url + "/api/generate",
                json={"model": self.model, "keep_alive": 0, "stream": False},
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as e:
            raise LauncherError(
                f"Ollama at {self.url} did not take the unload of {self.model}: {_why(e)}",
                hint="is `ollama serve` running there?",
            ) from None
        if r.status_code == 404:
            return  # Ollama no longer has the model: nothing of it is loaded
        if r.status_code != 200:
            raise LauncherError(
                f"Ollama at {self.url} refused to unload {self.model}: HTTP {r.status_code} "
                f"{_error_text(r)}"
            )
        deadline = time.monotonic() + grace_s
        while self.model in self.ps():
            if time.monotonic() >= deadline:
                raise LauncherError(
                    f"Ollama still has {self.model} loaded {grace_s:g}s after the unload",
                    hint="requests in flight hold it; Ollama unloads it when they end",
                )
            time.sleep(0.1)

    def log_tail(self, handle: Handle, lines: int = 20) -> str:
        """The loader's output (Ollama's own log is the daemon's, not ours)."""
        if not handle.log:
            return ""
        return tail_file(Path(handle.log), lines, limit=16384)  # never blocks on a FIFO

    def find(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle | None:
        """The model, when Ollama has it loaded (a handle with nothing to signal)."""
        try:
            return Handle(kind=KIND, proof=self.model) if self.model in self.ps() else None
        except LauncherError:
            return None

    def close(self) -> None:
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None

    # -- helpers

    def _log_path(self, service: ServiceConfig) -> Path | None:
        if self.log_dir is None:
            return None
        return self.log_dir / f"{service.name}.ollama-load.log"

    def _loader_alive(self, handle: Handle) -> bool:
        """Whether the handle's loader still runs: our own child, or (from a record) the
        same process by its start time, and a loader by its command line. Never a pid
        that is merely alive: stop signals what this says is a loader."""
        if self._loader is not None and handle.pid == self._loader.pid:
            return self._loader.poll() is None
        if not handle.pid or handle.pid_start is None:
            return False

        if not procinfo.is_same_process(handle.pid, handle.pid_start):
            return False
        argv = (procinfo.command_of(handle.pid) or "").split()
        return "gpuctl.adapters.launchers.ollama_loader" in argv and self.model in argv


def check_ollama(
    url: str,
    model: str,
    timeout_s: float,
    client: httpx.Client,
    others: frozenset[str] | None = None,
) -> Health:
    """A model's health from ``/api/ps`` (``status``); never raises.

    Ollama lists a model from the moment its load begins and holds requests for it until
    it is loaded, so to an onlooker a listed model is ready: a request waits, nothing
    starts twice.

    ``others``: the models the host's other services name. Given, the memory counts every
    model Ollama has loaded but those, whatever loaded it (a client of the service's
    Ollama can load any model it has): Ollama's memory is what Ollama reports, not what
    gpuctl asked of it. Given to one service per Ollama, so nothing counts twice.
    """
    lx = OllamaLauncher(url, model, client=client, timeout_s=timeout_s)
    try:
        loaded = lx.ps()
    except LauncherError as e:
        return _unreachable(e)
    found = loaded.get(lx.model)
    health = _listed(lx.url, lx.model, found)
    if others is None or found is None:
        return health
    mine = {normalize_model(m) for m in others} | {lx.model}
    extra = sorted((n, m.vram_mib) for n, m in loaded.items() if n not in mine and m.vram_mib)
    if not extra:
        return health
    more = sum(mib for _, mib in extra)
    names = ", ".join(n for n, _ in extra)
    detail = f"{health.detail}; with {format_mib(more)} of other models loaded there ({names})"
    return Health(health.state, detail, health.status_code, found.vram_mib + more)


def _unreachable(e: LauncherError) -> Health:
    state = "timeout" if "timed out" in e.message.lower() else "refused"
    return Health(state, e.message)


def _listed(url: str, model: str, found: LoadedModel | None) -> Health:
    if found is None:
        return Health("refused", f"{model} is not loaded in Ollama at {url}")
    return Health("ready", f"{model} is loaded in Ollama ({_placed(found)})", 200, found.vram_mib)


def _mib(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value // 2**20
    return 0


def _placed(m: LoadedModel) -> str:
    if m.size_mib and m.vram_mib < m.size_mib:
        return (
            f"{format_mib(m.vram_mib)} of {format_mib(m.size_mib)} on the GPU, the rest on the CPU"
        )
    return f"{format_mib(m.vram_mib)} on the GPU"


def _why(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text.splitlines()[0][:200]


def _error_text(r: Any) -> str:
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        err = None
    return str(err)[:200] if err else ""
