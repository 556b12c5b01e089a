"""Phases heal: the phase a record should say, given what its server is seen doing.

A record is written by callers that can die at any instruction (``kill -9``, Ctrl-C), so
its phase can lie about its server: a preemptor killed between marking its victim
``preempted`` and signalling it leaves a live server under a record that says it is not
running; a server that exits on its own leaves ``running`` over a dead pid; a start
whose caller went away (an agentless host, ``--no-wait``, a resume) stays ``starting``
though its server answers; a preemptor killed before it launched leaves its own
``starting`` record with no nonce and no server. Whoever reads a record with the right
to write it and sees its server's truth writes the phase that is true
(``gpuctl.flows.heal``), under the service's lease, and notes what it did in the record
(an attempt entry with ``outcome = "repaired"``, shown by ``gpuctl locks``).

The rule here is pure: ``diagnose`` takes the record and what was seen of its server.
It never overrides a live lease (a real start, stop or wake is under way: its holder
owns the record) and never touches a ``gpuctl run`` job's record (the job's own death
rules apply there: ``core.jobs``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec.structs import replace

from gpuctl.core.jobs import is_job
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_shapes import RecordUpdate, StartFailure

REPAIRED = "repaired"
# What a process launcher's server cannot tell once it has gone: it was exec'd detached,
# so its parent (the gpuctl that started it) is gone and init reaped its exit status.
EXIT_UNKNOWN = "exit status unknown"
# How long a start that launched nothing may stay ``starting`` when the reader does not
# know the service's health timeout (the agent has no config): the longest cold start
# gpuctl expects (a large vLLM on a DGX Spark, ten minutes) with room to spare. A reader
# with the service in its config uses its ``health_timeout``.
ABANDONED_AFTER_S = 900.0


class ServerTruth(msgspec.Struct, frozen=True):
    """What a caller saw of a record's server. None: could not be told from here.

    ``alive``: the handle's process (pid with its start time; a zombie is dead) runs.
    Only a caller on the server's machine can tell; elsewhere it is None.
    ``answers``: the record's health URL answered 200 just now.
    ``exit_code``: the server's exit status, where its launcher could learn it.
    """

    alive: bool | None = None
    answers: bool | None = None
    exit_code: int | None = None


class Repair(msgspec.Struct, frozen=True):
    """The phase to write and why, as one line (``preempted -> running: …``)."""

    service: str
    was: Phase
    phase: Phase
    why: str
    failed: bool = False  # write it as a failure (the server exited with an error)

    @property
    def line(self) -> str:
        return f"{self.was.value} -> {self.phase.value}: {self.why}"

    def update(self, now: float, by: str) -> RecordUpdate:
        """The store update (``core.record_shapes.apply_update``) that writes it, with its note."""
        note: dict[str, Any] = {"outcome": REPAIRED, "ended": now, "repaired": self.line, "by": by}
        out = RecordUpdate(attempt=note)
        if self.failed:
            out = replace(out, failure=StartFailure(self.why))
        else:
            out = replace(out, phase=self.phase)
        if self.phase is Phase.STOPPED or self.failed:
            out = replace(out, handle=None)
        if self.phase is Phase.RUNNING:
            out = replace(out, failure=None)
        return out


def needs_look(record: Record) -> bool:
    """Whether a record could be lying about its server, so its truth is worth reading
    (a health request, a pid look-up): most records cost nothing."""
    if is_job(record.service):
        return False
    if record.phase is Phase.PREEMPTED:
        # Its handle is cleared once its stop is done: a handle left means the stop may
        # never have happened.
        return bool(record.handle)
    if record.phase is Phase.STARTING:
        return True
    if record.phase in (Phase.RUNNING, Phase.SLEEPING):
        return isinstance((record.handle or {}).get("pid"), int)
    return False


def diagnose(
    record: Record,
    truth: ServerTruth,
    *,
    lease_live: bool,
    now: float = 0.0,
    abandoned_after_s: float = ABANDONED_AFTER_S,
) -> Repair | None:
    """The repair ``record`` needs given ``truth``, or None when its phase is true (or
    cannot be told).

    - ``preempted`` while its server runs (its process, or its health answers): its
      preemptor died before the stop, so nothing stopped it: ``running`` again, a victim
      to be picked again, reclaimed when idle, never resumed over itself.
    - ``starting`` whose server answers: ``running`` (as ``touch`` does), so a batch a
      resume started on a host with no agent is a victim again.
    - ``starting`` whose handle's process is dead, with nobody waiting on it (no live
      lease: ``--no-wait``, a resume, a caller that died): ``failed``, with its back-off,
      as the waiting ``ensure`` would have written; its promise counts no more.
    - ``starting`` with no start nonce, no handle and no live lease, for longer than
      ``abandoned_after_s`` (the service's health timeout) since it was marked: the
      preemptor that promised it died before launching anything (ensure writes a nonce
      before every spawn), and no admission counts it any more: ``stopped``. Before
      that, a start by an older client (no nonce) may still be loading: its health tells.
    - ``running`` or ``sleeping`` whose handle's process is dead: ``stopped`` when it
      exited 0, ``failed`` when it did not, and ``stopped`` saying its exit status is
      unknown where it cannot be learned.
    """
    if lease_live or is_job(record.service):
        return None
    phase = record.phase
    runs = truth.alive is True or truth.answers is True
    if phase is Phase.PREEMPTED and record.handle and runs:
        return Repair(
            record.service,
            phase,
            Phase.RUNNING,
            "its server still runs (the preemptor stopped before signalling it)",
        )
    if phase is Phase.STARTING:
        if truth.answers is True:
            return Repair(record.service, phase, Phase.RUNNING, "its server answers")
        if record.handle and truth.alive is False:
            # No lease: nobody waits on this start to record how it ended.
            pid = record.handle.get("pid")
            return Repair(
                record.service,
                phase,
                Phase.FAILED,
                f"its server (pid {pid}) exited while it was starting",
                failed=True,
            )
        if (
            not record.start_nonce
            and not record.handle
            and truth.alive is not True
            and now - record.since >= abandoned_after_s
        ):
            return Repair(
                record.service,
                phase,
                Phase.STOPPED,
                f"nothing was launched in {abandoned_after_s:g}s (the start's holder is gone)",
            )
        return None
    if phase in (Phase.RUNNING, Phase.SLEEPING) and truth.alive is False:
        pid = (record.handle or {}).get("pid")
        code = truth.exit_code
        if code is None:
            return Repair(
                record.service,
                phase,
                Phase.STOPPED,
                f"its server (pid {pid}) is gone, {EXIT_UNKNOWN}",
            )
        if code == 0:
            return Repair(record.service, phase, Phase.STOPPED, f"its server (pid {pid}) exited 0")
        return Repair(
            record.service,
            phase,
            Phase.FAILED,
            f"its server (pid {pid}) exited with status {code}",
            failed=True,
        )
    return None


def last_repair(record: Record) -> dict[str, Any] | None:
    """The record's latest repair note, for ``gpuctl locks``; None when it has none."""
    notes = [a for a in record.attempts if is_repair(a)]
    return notes[-1] if notes else None


def is_repair(attempt: dict[str, Any]) -> bool:
    """A repair note, not a start: ``gpuctl locks`` counts starts without them."""
    return bool(attempt.get("outcome") == REPAIRED)
