"""The event-order fuzz of issue 22, longer: random creates, deletes, scale-ups and -downs, moves,
resizes, node loss and return and operator restarts against the real operator on KMock, with pods that
take a random time to terminate (tests/operator/fuzzing.py, tests/operator/kubelet.py). The
invariant, checked at every tick: for every GPU, the sum over every pod that may be running on it
is within its budget, and no pod starts where no stored status books it.

The run is on a virtual clock (looptime, as Kopf's own tests use): the random waits, the pods'
termination grace and the operator's own timers take no wall time, so a seed fixes the run
(the same actions, the same pods started) and the wall time measures the work, not the sleeps.

Prints a table (one row per seed), then as its LAST line one JSON object whose keys end in their
units. Exit status 1 when any seed broke the invariant.

    .venv/bin/python benchmarks/event_fuzz.py [--seeds 10] [--steps 150] [--first-seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--first-seed", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    from fuzzing import fuzz

    rows, broken, pods, t0 = [], 0, 0, time.monotonic()
    print(f"{'seed':>6} {'steps':>6} {'pods':>6} {'restarts':>9} {'seconds':>8}  violations")
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        t = time.monotonic()
        out = await fuzz(seed, args.steps)
        dt = time.monotonic() - t
        rows.append(out)
        broken += bool(out.violations)
        pods += out.pods_started
        print(f"{seed:>6} {out.steps:>6} {out.pods_started:>6} {out.restarts:>9} {dt:>8.1f}  "
              f"{out.violations[0] if out.violations else '-'}")
    total = time.monotonic() - t0
    print(json.dumps({"seeds_count": args.seeds, "steps_per_seed_count": args.steps, "pods_started_count": pods,
                      "runs_breaking_invariant_count": broken, "wall_s": round(total, 1)}))
    return 1 if broken else 0


def run_on_virtual_clock() -> int:
    import looptime

    loop = looptime.new_event_loop()  # enabled from the start
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(run_on_virtual_clock())
