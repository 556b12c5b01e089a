"""Resume: bring a preempted service back once it fits.

A resume is an ``ensure`` that never preempts: the service comes back when it fits beside
what runs now (IDLE, FITS), else it stays preempted and the answer is BUSY (exit 3). It
happens three ways:

- ``gpuctl resume SERVICE``: the user asks for it (any service; one that was not
  preempted is simply ensured, without preempting);
- in ``gpuctl reclaim``, after its stops: every ``resume = true`` service whose record
  says ``preempted``, highest priority first;
- at the end of a ``gpuctl run``, the same way.

The automatic ones do not wait for the server to be ready (``--no-wait``): the start is
recorded under the admission lock, so the next resume counts it at its budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
from msgspec.structs import replace

from gpuctl.adapters.store.base import Store
from gpuctl.config import Config, ServiceConfig
from gpuctl.core.record import Phase
from gpuctl.errors import GpuctlError
from gpuctl.flows import story
from gpuctl.flows.deps import EnsureDeps, EnsureRequest
from gpuctl.flows.ensure.rounds import ensure
from gpuctl.flows.op_results import EnsureResult


def resume(deps: EnsureDeps, req: EnsureRequest | None = None) -> EnsureResult:
    """Start ``deps.service`` if it fits now, never stopping anything for it, whatever
    ``req`` or the service's ``preempt = true`` say (neither is changed)."""

    req = req or EnsureRequest(entry="resume")
    svc = deps.service
    try:
        phase = deps.store.get(svc.name).phase
    except GpuctlError:
        phase = None
    never = replace(deps, service=replace(svc, preempt=False))
    result = ensure(never, replace(req, preempt=False))
    if phase is Phase.PREEMPTED and result.exit_code == 0:
        story.tell(
            deps.store,
            story.ev("resume", svc.name, req.entry, before=phase, reason=result.reason),
        )
    if phase is not None and phase is not Phase.PREEMPTED:
        result.notes.insert(0, f"{svc.name} was not preempted (phase {phase.value})")
    return result


class Resumed(msgspec.Struct, frozen=True):
    """One automatic resume and how it ended."""

    service: str
    result: EnsureResult | None = None
    error: str | None = None

    would: bool = False  # a dry run: it would be tried

    @property
    def started(self) -> bool:
        return self.result is not None and self.result.exit_code == 0

    @property
    def failed(self) -> bool:
        """A start that failed (not a refusal: BUSY leaves it preempted for next time)."""
        return self.error is not None or (
            self.result is not None and self.result.exit_code not in (0, 3)
        )


def to_resume(config: Config, host: str, store: Store) -> list[ServiceConfig]:
    """The host's ``resume = true`` services whose record says ``preempted``, highest
    priority first (then by name, a stable order)."""
    candidates = [s for s in config.services_on(host) if s.resume]
    if not candidates:
        return []
    phases = {r.service: r.phase for r in store.records()}
    due = [s for s in candidates if phases.get(s.name) is Phase.PREEMPTED]
    return sorted(due, key=lambda s: (-s.priority, s.name))


def resume_preempted(
    services: Sequence[ServiceConfig],
    make_deps: Callable[[ServiceConfig], EnsureDeps],
    entry: str,
) -> list[Resumed]:
    """Resume each of ``services`` in order, without waiting for them to be ready. A
    refusal (BUSY: it does not fit yet) leaves it preempted for the next time.
    ``entry``: who resumes them (``reclaim``, ``run``)."""
    out = []
    for svc in services:
        deps = make_deps(svc)
        try:
            out.append(Resumed(svc.name, resume(deps, EnsureRequest(entry=entry, wait=False))))
        except GpuctlError as e:
            out.append(Resumed(svc.name, error=e.message))
        finally:
            deps.close()
    return out
