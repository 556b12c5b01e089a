"""What a user can do about an ``ensure`` that did not end ready: the ``hint:`` line
every refusal (BUSY, UNKNOWN, FAILED, not ready in time) ends with."""

from __future__ import annotations

from gpuctl.core.decision import Verdict, owner_of
from gpuctl.core.jobs import is_job
from gpuctl.flows.deps import EnsureDeps
from gpuctl.flows.op_results import Outcome


def refusal_hint(deps: EnsureDeps, outcome: Outcome, verdict: Verdict | None = None) -> str:
    """What the user can do about an ``ensure`` that did not end ready (empty otherwise)."""
    name = deps.service.name
    if verdict is not None and verdict.hint:
        return verdict.hint
    # PREEMPTABLE's hint (`gpuctl ensure X --preempt` stops …) comes with its verdict.
    if outcome is Outcome.BUSY:
        services = deps.config.services_on(deps.service.host)
        # Ours as the decision told them (a record's pid counts); by keywords otherwise.
        told = dict(verdict.ours) if verdict else {}
        ours: dict[str, None] = {}
        users: dict[str, None] = {}
        for p in verdict.holders if verdict else ():
            owner = owner_of(p.command, services, p.pid)
            whose = told.get(p.pid) or (owner.name if owner is not None else None)
            if whose is not None:
                ours.setdefault(whose, None)
            elif p.user:
                users.setdefault(p.user, None)
        steps = ["wait and try again"]
        # `gpuctl stop` is for services this config names; a run job ends with its
        # command, and a service only another config names is stopped from there.
        named = {s.name for s in services}
        steps += [f"`gpuctl stop {s}`" for s in [n for n in ours if n in named][:2]]
        strangers = [n for n in ours if n not in named and not is_job(n)]
        if strangers:
            steps.append(
                f"{', '.join(strangers[:2])}: not in this config, stop it from one that names it"
            )
        if users:
            steps.append(f"ask {', '.join(list(users)[:3])} to free it")
        return "; ".join(steps) + "; `gpuctl status` shows who holds the GPU"
    if outcome is Outcome.UNKNOWN:
        return f"check the agent of host {deps.host.name} (`gpuctl status -H {deps.host.name}`)"
    if outcome is Outcome.FAILED:
        return (
            f"see {_its_log(deps)} and `gpuctl locks`; fix the cause, then "
            f"`gpuctl ensure {name}` again (`gpuctl stop {name}` ends its back-off at once)"
        )
    if outcome is Outcome.TIMEOUT:
        return (
            f"it may still be loading: `gpuctl status` shows it; wait longer with "
            f"`gpuctl ensure {name} --timeout DURATION`"
        )
    return ""


def _its_log(deps: EnsureDeps) -> str:
    """Where the failed server's output is, as its record's handle names it: its log
    file, else its container's logs; "its log" when the record cannot be read."""
    from gpuctl.core.safe_text import visible
    from gpuctl.errors import GpuctlError

    try:
        handle = deps.store.get(deps.service.name).handle or {}
    except GpuctlError:
        return "its log"
    log, container = handle.get("log"), handle.get("container_name") or handle.get("container_id")
    if isinstance(log, str) and log:
        return f"its log ({visible(log)})"
    if isinstance(container, str) and container:
        return f"its log (`docker logs {visible(container)}`)"
    return "its log"
