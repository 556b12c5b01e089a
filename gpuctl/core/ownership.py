"""Whose is a process: a service's by the pid its record names, else by its keywords.

The decision and the memory accounting both ask this, so it lives on its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Protocol

from gpuctl.core.redact import redact_command
from gpuctl.core.snapshot import GpuProcess, StartingProcess
from gpuctl.core.units import format_mib


class ServiceSpec(Protocol):
    """What the decision needs of a service (``gpuctl.config.ServiceConfig`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def keywords(self) -> tuple[str, ...]: ...
    @property
    def default_match(self) -> bool:
        """True when ``keywords`` is the default (the service's name; no ``match`` set):
        it then counts only as a whole word of a command line (``names``)."""

    @property
    def memory_mib(self) -> int | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def health_timeout_s(self) -> float: ...
    @property
    def devices(self) -> tuple[int, ...] | None:
        """The GPU indexes the service may use; None: any one GPU."""


def loading_match(
    spec: ServiceSpec, s: StartingProcess, servers: Mapping[int, str] | None = None
) -> bool:
    """A host process not on the GPU that counts as this service loading.

    Either the service's record names it (its launcher recorded its pid), or its command
    carries a keyword and it is younger than the service's health timeout: a model
    server does not read weights for longer than that, while a `tail -f` of its log or
    an editor on its config can sit there for days, and must not block starts.
    """
    if servers and s.pid in servers:
        return servers[s.pid] == spec.name
    return owns(spec, s.command) and (s.age_s is None or s.age_s < spec.health_timeout_s)


def loading_owner(
    s: StartingProcess, specs: Sequence[ServiceSpec], servers: Mapping[int, str] | None = None
) -> ServiceSpec | None:
    """The service a host process off the GPU counts as loading (``owner_of``, then
    ``loading_match``), or None: the one rule the decisions, the memory accounting and
    status's list of starting processes share."""
    owner = owner_of(s.command, specs, s.pid, servers)
    return owner if owner is not None and loading_match(owner, s, servers) else None


def owns(spec: ServiceSpec, command: str | None) -> bool:
    """True when a command line carries one of the service's match keywords (case-insensitive).

    Keywords the user set (``match``) are a substring of the command line, as promised.
    The default, the service's name, must be a whole word (``names``): a name like
    ``chat`` sits inside many command lines that are not the service (``tail -f
    …/logs/chat.log``, ``less chat-notes.txt``, a load test of ``/v1/chat/completions``).
    """
    if not command:
        return False
    if spec.default_match:
        return any(names(command, k) for k in spec.keywords)
    low = command.lower()
    return any(k.lower() in low for k in spec.keywords)


def names(command: str, word: str) -> bool:
    """True when ``word`` is a whole argument of the command line (``--name chat``, also
    ``--name=chat``) or its program's base name (``/opt/venv/bin/vllm``, the script or
    module an interpreter runs: ``python serve/chat.py``, ``python -m vllm.entrypoints…``),
    case-insensitive; never a part of a path, a file name or a URL.

    The command line is the argv joined with spaces (as the agent reports it), so an
    argument is a run of non-blanks; ``sh -c "vllm serve …"`` names ``vllm``.
    """
    want = word.lower()
    if not want:
        return False
    words = command.lower().split()
    for w in words:
        if w == want or (w.startswith("-") and w.partition("=")[2] == want):
            return True
    return want in _programs(words)


# Programs that run another one named by their first argument (a script, or ``-m MODULE``).
_INTERPRETER = re.compile(r"(python|pypy)[\d.]*|node|ruby|perl|bash|sh|dash|zsh")


def _programs(words: list[str]) -> set[str]:
    """The base names (with and without their extension) of what the command runs."""
    i = 0
    # `env A=1 vllm serve`, `A=1 vllm serve` (a shell's assignments before the program).
    while i < len(words) and (
        _base(words[i]) == "env" or ("=" in words[i] and not words[i].startswith("-"))
    ):
        i += 1
    if i >= len(words):
        return set()
    prog = _base(words[i])
    found = {prog, _stem(prog)}
    if _INTERPRETER.fullmatch(prog):
        rest = words[i + 1 :]
        for j, w in enumerate(rest):
            module = rest[j + 1] if w == "-m" and j + 1 < len(rest) else None
            if module is None and w.startswith("-m") and len(w) > 2:
                module = w[2:]
            if module is not None:
                found |= {module, module.split(".", 1)[0]}
                break
            if not w.startswith("-"):
                found |= {_base(w), _stem(_base(w))}
                break
    return found


def _base(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def _stem(base: str) -> str:
    return base.rsplit(".", 1)[0] if "." in base[1:] else base


def owner_of(
    command: str | None,
    specs: Sequence[ServiceSpec],
    pid: int | None = None,
    servers: Mapping[int, str] | None = None,
) -> ServiceSpec | None:
    """The service a process belongs to: the one whose record names its pid (its launcher
    recorded it: true whatever its command line says), else the first whose keywords match."""
    if servers and pid is not None and pid in servers:
        name = servers[pid]
        return next((s for s in specs if s.name == name), None)
    for s in specs:
        if owns(s, command):
            return s
    return None


def describe_process(p: GpuProcess, width: int = 72) -> str:
    """``pid 123 (python -m vllm… , 8.0 GiB)``: short, but with what tells one job from another.

    The program is named by its base name: a long venv path would push the arguments
    (the model, the job's name) out of the cut.
    """
    mem = format_mib(p.memory_mib)
    return f"pid {p.pid} ({short_command(p.command, width)}, {mem})"


def short_command(command: str | None, width: int = 72) -> str:
    """The program by its base name and its arguments, secrets redacted, cut to ``width``."""
    if command is None:
        return "<command not visible>"
    words = redact_command(command).split()
    cmd = " ".join([words[0].rsplit("/", 1)[-1], *words[1:]]) if words else ""
    if len(cmd) > width:
        cmd = cmd[: width - 1] + "…"
    return cmd
