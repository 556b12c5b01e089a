"""``gpuctl.core.heal``: which phase a record should say, given what its server does
(pure: the end-to-end cases are in test_heal.py)."""

from __future__ import annotations

import pytest

from gpuctl.core.heal import (
    EXIT_UNKNOWN,
    REPAIRED,
    ServerTruth,
    diagnose,
    is_repair,
    last_repair,
    needs_look,
)
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_shapes import apply_update

HANDLE = {"kind": "process", "pid": 4242, "pid_start": 1000.0}


def rec(phase: Phase, **kw: object) -> Record:
    return Record(service="batch", phase=phase, since=1.0, **kw)  # type: ignore[arg-type]


def test_preempted_over_a_live_server_runs_again() -> None:
    r = rec(Phase.PREEMPTED, handle=HANDLE)
    assert needs_look(r)
    for truth in (ServerTruth(alive=True), ServerTruth(answers=True)):
        fix = diagnose(r, truth, lease_live=False)
        assert fix is not None and fix.phase is Phase.RUNNING
        assert fix.line.startswith("preempted -> running: its server still runs")
    # Its stop was done (handle cleared), or its server is gone, or cannot be told.
    assert diagnose(rec(Phase.PREEMPTED), ServerTruth(answers=True), lease_live=False) is None
    assert not needs_look(rec(Phase.PREEMPTED))
    assert diagnose(r, ServerTruth(alive=False), lease_live=False) is None
    assert diagnose(r, ServerTruth(), lease_live=False) is None


def test_a_live_lease_owns_the_record() -> None:
    r = rec(Phase.PREEMPTED, handle=HANDLE)
    assert diagnose(r, ServerTruth(alive=True), lease_live=True) is None
    dead = rec(Phase.RUNNING, handle=HANDLE)
    assert diagnose(dead, ServerTruth(alive=False), lease_live=True) is None


def test_run_jobs_are_left_to_their_own_rules() -> None:
    job = Record(service="run.whisper", phase=Phase.RUNNING, handle={"kind": "run", "pid": 5})
    assert not needs_look(job)
    assert diagnose(job, ServerTruth(alive=False), lease_live=False) is None


def test_starting_that_answers_runs() -> None:
    r = rec(Phase.STARTING, handle=HANDLE, start_nonce="ab" * 8)
    fix = diagnose(r, ServerTruth(alive=True, answers=True), lease_live=False)
    assert fix is not None and fix.phase is Phase.RUNNING
    # Still loading: its own start (or ensure's orphan rule) finishes it.
    assert diagnose(r, ServerTruth(alive=True, answers=False), lease_live=False) is None


def test_starting_that_never_launched_is_stopped() -> None:
    r = rec(Phase.STARTING)  # no nonce, no handle: a killed preemptor's promise
    no = ServerTruth(answers=False)
    fix = diagnose(r, no, lease_live=False, now=62.0, abandoned_after_s=60.0)
    assert fix is not None and fix.phase is Phase.STOPPED
    assert "nothing was launched in 60s" in fix.why
    # Within its health timeout it may be an older client's start (no nonce) still
    # loading; its health will tell.
    assert diagnose(r, no, lease_live=False, now=30.0, abandoned_after_s=60.0) is None
    assert diagnose(r, no, lease_live=False, now=600.0) is None  # 15 minutes by default
    up = diagnose(r, ServerTruth(answers=True), lease_live=False, now=62.0, abandoned_after_s=60.0)
    assert up is not None and up.phase is Phase.RUNNING
    # A nonce means a spawn may have happened: ensure finds its server by it.
    assert (
        diagnose(rec(Phase.STARTING, start_nonce="ab" * 8), ServerTruth(), lease_live=False) is None
    )


@pytest.mark.parametrize(
    ("code", "phase", "words"),
    [
        (None, Phase.STOPPED, f"is gone, {EXIT_UNKNOWN}"),
        (0, Phase.STOPPED, "exited 0"),
        (3, Phase.FAILED, "exited with status 3"),
    ],
)
def test_running_over_a_dead_server(code: int | None, phase: Phase, words: str) -> None:
    r = rec(Phase.RUNNING, handle=HANDLE)
    assert needs_look(r)
    fix = diagnose(r, ServerTruth(alive=False, exit_code=code), lease_live=False)
    assert fix is not None and fix.phase is phase and words in fix.why
    healed = apply_update(r, fix.update(50.0, "reclaim"), 50.0)
    assert healed.phase is phase and healed.handle is None and healed.since == 50.0
    assert (healed.failure is not None) is (phase is Phase.FAILED)
    note = last_repair(healed)
    assert note is not None and is_repair(note)
    assert note == {
        "outcome": REPAIRED,
        "ended": 50.0,
        "repaired": fix.line,
        "by": "reclaim",
    }
    # Alive, or cannot be told: nothing to repair.
    assert diagnose(r, ServerTruth(alive=True), lease_live=False) is None
    assert diagnose(r, ServerTruth(), lease_live=False) is None


def test_healed_to_running_keeps_its_handle_and_clears_a_failure() -> None:
    r = rec(Phase.PREEMPTED, handle=HANDLE)
    fix = diagnose(r, ServerTruth(alive=True), lease_live=False)
    assert fix is not None
    healed = apply_update(r, fix.update(9.0, "agent"), 9.0)
    assert healed.phase is Phase.RUNNING and healed.handle == HANDLE and healed.failure is None
    assert not is_repair({"outcome": "ready", "duration_s": 1.0})


def test_a_start_whose_server_died_fails_unless_someone_waits_on_it() -> None:
    r = rec(Phase.STARTING, handle=HANDLE, start_nonce="ab12cd34ef56")
    fix = diagnose(r, ServerTruth(alive=False), lease_live=False)
    assert fix is not None and fix.phase is Phase.FAILED and fix.failed
    assert fix.line.startswith("starting -> failed: its server (pid 4242) exited")
    done = apply_update(r, fix.update(5.0, "agent"), 5.0)
    assert done.phase is Phase.FAILED and done.handle is None and done.failure is not None
    # Its waiting ensure (a live lease) records the end itself; unknown tells nothing.
    assert diagnose(r, ServerTruth(alive=False), lease_live=True) is None
    assert diagnose(r, ServerTruth(alive=None), lease_live=False) is None
