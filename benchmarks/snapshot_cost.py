"""What one decision path over snapshots costs (issue 29), at cluster and fleet size.

The ledger of benchmarks/plan_scale.py's seeded cluster and deployment stream (placement.plan of
every deployment). Measured, median of 200 samples each:

- snapshot: `Ledger.snapshot()` of the writer's ledger (what the lock's release publishes);
- deep copy: the copy every decision took before (`Ledger` rebuilt container by container, as
  `Ledger.copy` did: every node's bookings, every deployment's list, every index);
- publish + first change: a snapshot, then the writer's next booking and release (which copy the
  containers they touch);
- decide on a snapshot: a one-replica CREATE (no temporary booking: nothing copied), a three-replica
  CREATE and an UPDATE of a deployment that holds bookings (both book temporarily on a scratch
  copy), next to the same decisions in place on a private ledger (the CLI's plan).

Prints a table, then as its LAST line one JSON object whose keys end in their units.

    .venv/bin/python benchmarks/snapshot_cost.py [--nodes 1000] [--deployments 4000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_scale

from vllmfit.core import placement
from vllmfit.core.placement import (
    Ledger,
    layers,
)


def _flat(m) -> dict:
    """A layered map as one plain dict (C-speed: its base, then its own changes)."""
    if not hasattr(m, "delta"):
        return dict(m)
    out = dict(m.base)
    out.update(m.delta)
    return {k: v for k, v in out.items() if v is not layers._GONE} if m.delta else out


def deep_copy(led: Ledger) -> Ledger:
    """A full copy, container by container, as Ledger.copy did before snapshots (every decision
    of the operator and every re-placing paid it)."""
    new = Ledger()
    new.nodes = dict(led.nodes)
    new._slots = dict(led._slots)
    new._on_gpu = {n: {i: dict(b) for i, b in g.items()} for n, g in led._on_gpu.items()}
    new._used = _flat(led._used)
    new._by_deployment = {k: list(v) for k, v in _flat(led._by_deployment).items()}
    new.heads = _flat(led.heads if hasattr(led, "heads") else led._head)  # _head: a tree before it was public
    new._free = {k: list(v) for k, v in led._free.items()}
    new._by_type = {k: dict(v) for k, v in led._by_type.items()}
    new.census = led.census.copy()
    new._groups = {k: list(v) for k, v in led._groups.items()}
    new._group_key = dict(led._group_key)
    return new


def median_ms(fn, n: int = 200) -> float:
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--deployments", type=int, default=4000)
    a = ap.parse_args()
    rnd = random.Random(7)
    nodes = plan_scale.cluster(a.nodes, rnd)
    reqs = plan_scale.requests(a.deployments, a.nodes, rnd)
    t = time.perf_counter()
    led = placement.plan(nodes, reqs).ledger
    build_s = time.perf_counter() - t
    extra = plan_scale.requests(3, a.nodes, random.Random(9), prefix="x")
    one = dataclasses.replace(extra[0], spec=extra[0].spec.model_copy(update={"replicas": 1}))
    three = dataclasses.replace(extra[1], spec=extra[1].spec.model_copy(update={"replicas": 3}))
    held = next(r for r in reqs if led.bookings_of(r.key))

    def publish_and_change() -> None:
        led.snapshot()
        d = placement.decide(led, one)
        led.book(d)
        led.release(d.key)

    rows = {
        "snapshot": median_ms(led.snapshot),
        "deep_copy": median_ms(lambda: deep_copy(led), 20),
        "publish_and_first_change": median_ms(publish_and_change),
        "decide_create_1_replica_on_snapshot": median_ms(lambda: placement.decide(led.snapshot(), one)),
        "decide_create_3_replicas_on_snapshot": median_ms(lambda: placement.decide(led.snapshot(), three)),
        "decide_update_on_snapshot": median_ms(lambda: placement.decide(led.snapshot(), held)),
        "decide_create_3_replicas_in_place": median_ms(lambda: placement.decide(led, three)),
        "decide_update_in_place": median_ms(lambda: placement.decide(led, held)),
    }
    print(f"{a.nodes} nodes, {len(led.slots())} GPUs, {len(led.deployments())} deployments booked "
          f"(plan {build_s:.1f} s); medians")
    print(f"{'measure':<40}{'ms':>10}")
    for k, v in rows.items():
        print(f"{k:<40}{v:>10.3f}")
    print(json.dumps({"gpus_count": len(led.slots()), **{f"{k}_ms": round(v, 4) for k, v in rows.items()}}))


if __name__ == "__main__":
    main()
