"""The randomised trial runner in the suite, bounded in time (see tests/trials.py).

As many trials as fit in about a minute (a budget, not a timing assertion;
``GPUCTL_TRIALS_BUDGET_S`` sets another for a deeper run), and on past it (to four
minutes at most) while a preemption, a resume or a kill has not yet happened: the report
must show each of them, and no broken invariant.

The seed is fixed under CI (``CI=true``: ``tests.trials.CI_SEED``) and changes from run to
run elsewhere; it is printed with any violation, so a failure can be replayed:
``GPUCTL_TRIALS_SEED=<seed> pytest tests/test_trials.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.trials_configs
import tests.trials_priority
import tests.trials_reclaim  # noqa: F401  (registers reclaim, in_use requests and their checks)
from gpuctl.sim.host import SimHost
from tests.ensure_helpers import agent_host
from tests.trials import ACTIONS, COUNTED, TRIAL_GPU, run_trials, trial_seed

# Heavy: many processes at once, and windows that a second heavy test beside it would widen.
# With -n, the "heavy" group runs on one worker, one test after another.
pytestmark = pytest.mark.xdist_group("heavy")

BUDGET_S = float(os.environ.get("GPUCTL_TRIALS_BUDGET_S", "60"))
UNTIL_COUNTED_S = 240.0


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, gpu_memory=TRIAL_GPU)


@pytest.mark.slow
def test_random_trials_keep_the_invariants(host: SimHost) -> None:
    seed = trial_seed()
    report = run_trials(host, seed=seed, budget_s=BUDGET_S, until_counted_s=UNTIL_COUNTED_S)
    print(report.summary())
    assert report.violations == [], f"seed {seed}: {report.violations}"
    assert report.trials >= 1 and report.samples > 0
    # Preemption really happened (records turned `preempted`, and preemptors said whom
    # they stopped), a preempted service came back, and callers were killed.
    assert all(report.counts[k] > 0 for k in COUNTED), report.summary()
    # Every invariant was judged.
    for invariant in (
        "one server per service",
        "admitted memory within the total",
        "claimed memory within the total",
        "no out-of-memory line",
        "only permitted victims preempted",
        "named victims below their preemptor",
        "every stop explained",
        "service records match the processes",
        "job records match their CMDs",
        "no request cut in flight",
    ):
        assert report.checked[invariant] > 0, (invariant, report.summary())
    assert set(report.actions) <= set(ACTIONS)
    assert sum(report.actions.values()) >= 8
