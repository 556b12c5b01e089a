"""The one exception tree of gpuctl, and its exit codes.

Every error carries the exit code the CLI returns for it (docs/reference/exit-codes.md) and a hint
that names the fix. Commands convert these to one line on stderr; tracebacks
appear only with ``GPUCTL_DEBUG=1``.

::

    GpuctlError (exit 1)
     ├── ConfigError            config file or value is wrong (exit 1)
     ├── UsageError             unknown host / service, bad option combination (exit 2)
     ├── AgentUnavailable       agent down, hung, refused us, or spoke nonsense (exit 4)
     │    └── AgentAuthError    401/403 from the agent (exit 4)
     ├── Undecided              gpuctl cannot tell (a start may be hidden) (exit 4)
     ├── ProbeError             the local GPU probe failed (exit 4)
     │    ├── NoGpuFound        no NVIDIA driver / GPU here (exit 4)
     │    └── NvmlMismatch      binding and driver disagree (adapters.probes.nvml; exit 4)
     ├── StartFailed            a launch failed or the server died (exit 1)
     ├── StoreError             the state store is unreadable / unwritable (exit 1)
     │    └── NoStore           the host's agent keeps no records (no --state-dir)
     └── LauncherError          a launcher backend (Docker, Jupyter) refused us (exit 1)
          ├── Unproven          a record names a process without gpuctl's proof (exit 4)
          └── JupyterUnreachable  the Jupyter server did not answer
                                  (adapters.launchers.jupyter.errors; exit 1)

``gpuctl.sim`` cannot import this module (it runs on the standard library alone): its
``SimError`` carries the same ``message``, ``hint`` and ``exit_code``, and the CLI turns
it into one of these.

A refusal is not an exception: BUSY (exit 3), UNKNOWN (4) and TIMEOUT (5) of ``ensure``
are outcomes of its result (``gpuctl.flows.results.Outcome``), each with a hint.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes, a documented contract (docs/reference/exit-codes.md); scripts rely on them."""

    OK = 0
    FAILED = 1
    USAGE = 2
    BUSY = 3
    UNKNOWN = 4
    TIMEOUT = 5
    INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


class GpuctlError(Exception):
    """Base of every error gpuctl reports to a user.

    Attributes:
        message: one line saying what went wrong.
        hint: one line naming the fix, or empty.
    """

    exit_code: int = ExitCode.FAILED

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(GpuctlError):
    """The configuration is wrong; the message names the location (``services.vllm.memory``)."""


class UsageError(GpuctlError):
    """The command line asks for something that does not exist or does not make sense."""

    exit_code = ExitCode.USAGE


class AgentUnavailable(GpuctlError):
    """The host agent did not answer, hung, or answered something that is not the contract."""

    exit_code = ExitCode.UNKNOWN


class AgentAuthError(AgentUnavailable):
    """The agent refused our token (401/403)."""


class ProbeError(GpuctlError):
    """Reading the local GPU failed."""

    exit_code = ExitCode.UNKNOWN


class Undecided(GpuctlError):
    """gpuctl cannot tell (a start may be hidden): it says so rather than guess."""

    exit_code = ExitCode.UNKNOWN


class NoGpuFound(ProbeError):
    """There is no NVIDIA GPU (or driver) on this machine."""


class StartFailed(GpuctlError):
    """Launching a server failed, or it died while loading."""


class StoreError(GpuctlError):
    """The state directory cannot be read or written."""


class NoStore(StoreError):
    """The host's agent was started without a state directory: it keeps no records.

    Not a failure to read them: such a host's snapshot still stands, while a store that
    fails makes its services UNKNOWN.
    """


class LauncherError(GpuctlError):
    """A launcher backend (Docker Engine, Jupyter server, local process) refused us."""


class Unproven(LauncherError):
    """A record names a server that does not carry the proof its start left (the nonce
    in its environment, the container's label, the model): nothing was signalled.

    The records are writable by every token holder and group member, so a pid in one
    proves nothing; gpuctl can only tell that the process may not be its own (exit 4).
    """

    exit_code = ExitCode.UNKNOWN
