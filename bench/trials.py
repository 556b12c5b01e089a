"""Randomised trials on a simulated GPU host (tests/trials.py), as many as asked:

    nice .venv/bin/python bench/trials.py --trials 50 [--seed N] [--actions 8] [--budget S]

Prints the trials run, the actions taken by kind, the preemptions actually performed,
the resumes and kills, each invariant and how many times it was judged, the time, and
every violation (exit 1 when there is one). The suite runs the same loop for about two
minutes (tests/test_trials.py); this is for longer hunts. It is CPU-heavy: run it
``nice``d on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `tests.trials`

import tests.trials_configs
import tests.trials_priority
import tests.trials_reclaim  # noqa: F401  (registers reclaim, in_use requests and their checks)
from gpuctl.sim.host import SimHost
from tests.trials import TRIAL_GPU, run_trials, trial_seed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--trials",
        type=int,
        default=None,
        help="how many (default: 20, or as many as --budget fits)",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="default: GPUCTL_TRIALS_SEED, a fixed one where CI is set, else a fresh one",
    )
    ap.add_argument("--actions", type=int, default=8, help="actions per trial")
    ap.add_argument(
        "--budget", type=float, default=None, help="stop after this many seconds (and trials)"
    )
    args = ap.parse_args()
    seed = trial_seed(args.seed)
    with (
        tempfile.TemporaryDirectory(prefix="gpuctl-trials-") as tmp,
        SimHost(gpu_memory=TRIAL_GPU, root=Path(tmp) / "host") as host,
    ):
        # As the suite's fixture does: callers spawned with our environment (the in_use
        # requests) must use this host's sim GPU and state dir, not the defaults.
        os.environ["GPUCTL_STATE_DIR"] = str(host.state_dir)
        os.environ["GPUCTL_SIM_DIR"] = str(host.sim_dir)
        os.environ["GPUCTL_SIM_GPU_MEMORY"] = TRIAL_GPU
        host.start_agent()
        report = run_trials(
            host,
            seed=seed,
            trials=args.trials if args.trials is not None or args.budget else 20,
            budget_s=args.budget,
            actions_per_trial=args.actions,
        )
    print(report.summary())
    print("  actions:")
    for name, n in sorted(report.actions.items()):
        print(f"    {name:24} {n}")
    for v in report.violations:
        print(f"VIOLATION {v}")
    print("no violations" if not report.violations else f"{len(report.violations)} violations")
    return 1 if report.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
