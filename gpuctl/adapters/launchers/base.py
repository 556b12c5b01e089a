"""The launcher interface and the handle a launcher leaves in a service's record."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from gpuctl.config import ServiceConfig


class Handle(msgspec.Struct, frozen=True):
    """What a launcher needs to find its server again, stored in the service's record.

    ``pid``/``pid_start`` identify the server process itself (never a wrapper shell); the
    start time tells a reused pid from ours, ``pid_ns`` the PID namespace it is counted in. Docker fills ``container_id``/``container_name``,
    Jupyter ``terminal``, Slurm ``job_id``; ``log`` is the server's log file where there is one.
    """

    kind: str
    pid: int | None = None
    pid_start: float | None = None
    container_id: str | None = None
    container_name: str | None = None
    terminal: str | None = None
    log: str | None = None
    # The PID namespace ``pid`` is numbered in (``procinfo.pid_namespace``): only a
    # reader in the same one may take "no such pid" for "the server is gone".
    pid_ns: int | None = None
    # What the launcher's ``stop`` checks before it signals anything (``adapters.proof``):
    # the start nonce in the server's environment (process, jupyter), the value of the
    # container's ``gpuctl.proof`` label set when it was created (docker: a reused
    # container keeps its creation's), the model (ollama). Absent from a server started
    # before gpuctl kept it: such a server is reported, never signalled.
    proof: str | None = None
    # The Slurm launcher's job (``squeue --jobs``); its node is Slurm's to tell.
    job_id: str | None = None

    @property
    def locates(self) -> bool:
        """Whether it names a server at all: a pid, a container, a terminal or a job. A
        handle salvaged from a broken record may have lost the field that did."""
        return any(
            v is not None
            for v in (self.pid, self.container_id, self.container_name, self.terminal, self.job_id)
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Handle:
        # The declared names only: structs.fields() would resolve every annotation.
        names = set(cls.__struct_fields__)
        # A salvaged handle may have lost its kind (``codec.salvage``): "" is no
        # launcher's, so nothing acts on it as if it knew whose server it is.
        return cls(**{"kind": "", **{k: v for k, v in data.items() if k in names}})


class Launcher(Protocol):
    """Start, find, check and stop one service's server.

    Every method raises ``gpuctl.errors.LauncherError`` (or ``StartFailed`` from
    ``start``) with a one-line message and a hint naming the fix; never a raw
    library exception.
    """

    kind: str

    def start(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle:
        """Launch detached, so the server outlives the caller; return once it is spawned.

        ``start_nonce`` (the one the caller wrote into the record first) goes into the
        server's environment as ``GPUCTL_START_NONCE``, so the server of a start whose
        caller died before recording it can still be found.
        """
        ...

    def find(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle | None:
        """The service's server when it runs but no record names it (its caller died
        between spawning and recording it), else None."""
        ...

    def alive(self, handle: Handle) -> bool | None:
        """True while the server runs (a zombie is dead); None when it cannot be told."""
        ...

    def stop(self, handle: Handle, grace_s: float, service: str | None = None) -> None:
        """SIGTERM (or the engine's stop), SIGKILL after ``grace_s``. Idempotent.

        Only a server that carries the handle's ``proof``: a record is writable by
        every token holder, so the pid or container it names proves nothing. With
        ``service`` (the name of the record being acted on, never read from the handle),
        only a server started for that service (``GPUCTL_START_SERVICE``, the
        ``gpuctl.service`` label): a record copied from another service carries that
        one's proof too. Every flow passes it.

        Raises:
            Unproven: the server does not carry the proof; nothing was signalled.
        """
        ...

    def log_tail(self, handle: Handle, lines: int = 20) -> str:
        """The last lines of the server's log ('' when there is none)."""
        ...

    def close(self) -> None:
        """Release what the launcher holds open (a connection pool); idempotent."""
        ...


@runtime_checkable
class QueueReporter(Protocol):
    """A launcher whose servers may wait in a scheduler's queue before they run (Slurm).

    Such a start is LOADING while it waits, and says why: the wait loop shows it as its
    phase, and a look at a LOADING service names it instead of "its server runs"."""

    def queue_state(self, handle: Handle) -> str | None:
        """Why the server waits ("queued by Slurm: Resources"); None once it runs."""
        ...
