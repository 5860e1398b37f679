"""What hostile unique node affinities cost the operator: memory, and the next node join.

A cluster of `--nodes` nodes (8 GPUs each, benchmarks/plan_scale.py's seeded cluster) in the
writer's ledger, and its committed snapshot. `--reviews` dry-run reviews decide on the snapshot
(`placement.decide`, what the webhook runs), each with a required node affinity never seen before
(`id NotIn [u<i>]`: every node matches, so each cached selection names every node, the largest an
entry can be). Then `--joins` nodes join the writer's ledger one at a time, each join followed by
a publication (the snapshot the next reviews read), as the operator's loop does.

Measured: the resident set size before and after the reviews (after a full collection), the
selection cache's entries, and the median time of one node join (`Ledger.set_node` on the
writer's ledger, which carries the cached selections over). The same script runs against another
tree for a before/after comparison (PYTHONPATH=/path/to/other/operator).

Prints a table, then as its LAST line one JSON object whose keys end in their units.

    .venv/bin/python benchmarks/selection_cache.py [--nodes 1000] [--reviews 20000] [--joins 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_scale

from vllmfit.core import placement
from vllmfit.core.spec.api import VLLMDeploymentSpec
from vllmfit.sources import catalog


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def review(i: int, model: object) -> placement.Request:
    spec = VLLMDeploymentSpec.model_validate({
        "model": "Qwen/Qwen2.5-0.5B-Instruct", "kvCache": {"concurrency": 1},
        "podTemplate": {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "id", "operator": "NotIn", "values": [f"u{i}"]}]}]}}}}}})
    return placement.Request(f"bench/r{i}", spec, model, ("", f"bench/r{i}"))  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--reviews", type=int, default=20000)
    ap.add_argument("--joins", type=int, default=20)
    a = ap.parse_args()
    nodes = plan_scale.cluster(a.nodes, random.Random(7))
    ledger = placement.Ledger(nodes)
    snap = ledger.snapshot()
    model = catalog.model("Qwen/Qwen2.5-0.5B-Instruct")
    for i in range(3):  # warm: imports, lru caches
        placement.decide(snap, review(-1 - i, model))
    gc.collect()
    before = rss_mb()
    t = time.perf_counter()
    for i in range(a.reviews):
        placement.decide(snap, review(i, model))
    reviews_s = time.perf_counter() - t
    gc.collect()
    after = rss_mb()
    entries = len(snap.selections) if hasattr(snap, "selections") else len(snap._selected)
    template = nodes[0]
    joins = []
    for j in range(a.joins):
        info = placement.NodeInfo(f"joined-{j}", {**template.labels, "id": f"joined-{j}"},
                                  tuple(placement.GpuSlot(f"joined-{j}", s.index, s.gpu, policy=s.policy)
                                        for s in template.gpus))
        t = time.perf_counter()
        ledger.set_node(info)
        joins.append(time.perf_counter() - t)
        ledger.snapshot()  # published: the next join copies what it changes, as on the operator's loop
    join_ms = statistics.median(joins) * 1000
    rows = [("nodes", a.nodes), ("unique-affinity reviews", a.reviews), ("reviews per second", a.reviews / reviews_s),
            ("RSS before reviews (MB)", before), ("RSS after reviews (MB)", after),
            ("RSS growth (MB)", after - before), ("selection cache entries", entries),
            ("node join, median (ms)", join_ms), ("node join, first (ms)", joins[0] * 1000)]
    for k, v in rows:
        print(f"{k:<32}{v:>14.2f}" if isinstance(v, float) else f"{k:<32}{v:>14}")
    print(json.dumps({"nodes_count": a.nodes, "reviews_count": a.reviews, "rss_growth_mb": round(after - before, 1),
                      "selection_entries_count": entries, "node_join_median_ms": round(join_ms, 3),
                      "node_join_first_ms": round(joins[0] * 1000, 3),
                      "reviews_per_s": round(a.reviews / reviews_s, 1)}))


if __name__ == "__main__":
    main()
