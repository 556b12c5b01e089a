"""The randomised trial runner in the suite, bounded in time (see tests/trials.py).

The seed changes from run to run and is printed with any violation, so a failure can be
replayed: ``GPUCTL_TRIALS_SEED=<seed> pytest tests/test_trials.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.trials_priority
import tests.trials_reclaim  # noqa: F401  (registers reclaim, in_use requests and their checks)
from gpuctl import api
from gpuctl.sim.host import SimHost
from tests.trials import ACTIONS, run_trials

BUDGET_S = 60.0


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    api._reset_for_tests()
    with SimHost(root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h
    api._reset_for_tests()


def test_random_trials_keep_the_invariants(host: SimHost) -> None:
    seed = int(os.environ.get("GPUCTL_TRIALS_SEED") or time.time_ns() % 1_000_000)
    report = run_trials(host, seed=seed, budget_s=BUDGET_S)
    assert report.violations == [], f"seed {seed}: {report.violations}"
    assert report.trials >= 1 and report.samples > 0
    # Every kind of action had its chance (the weights make each likely in a few trials).
    assert set(report.actions) <= set(ACTIONS)
    assert sum(report.actions.values()) >= 8
