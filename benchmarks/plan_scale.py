"""Placement at cluster scale: a full plan, one more admission, memory, and packing quality.

A synthetic cluster of 1,000 nodes x 8 GPUs (H100 80GB, A100 80GB, A100 40GB and L40S nodes, some
GPUs with foreign use) and 4,000 deployments from 0.5B to 70B (mostly explicit maxModelLen and
maxNumSeqs, some unset, some with a nodeSelector or pinned to a node), all seeded. Measured:

- full plan: placement.plan of every deployment onto the empty cluster (median of 3 rounds);
- one admission: decide + book of one more deployment into the full ledger (1,000 samples, each
  released again), p50 and p99; and decide of a deployment that fits nowhere (p50 of 20);
- peak RSS of this process (resource.getrusage);
- packing: GPUs in use, versus one GPU per process (the stock device plugin: tp x pp whole GPUs
  per replica) and versus a lower bound (per product, total booked bytes / one GPU's budget).

Pinned to two CPU cores, like CI. Prints a table, then as its LAST line one JSON object whose keys
end in their units.

    .venv/bin/python benchmarks/plan_scale.py [--nodes 1000] [--deployments 4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import time

from vllmfit.core import defaults, placement
from vllmfit.core.api import VLLMDeploymentSpec
from vllmfit.sources import catalog

PRODUCTS = (
    ("NVIDIA-H100-80GB-HBM3", 4, "large"),
    ("NVIDIA-A100-SXM4-80GB", 3, "large"),
    ("NVIDIA-A100-SXM4-40GB", 2, "medium"),
    ("NVIDIA-L40S", 1, "medium"),
)  # (product, weight, pool)
MIX = (  # (model, tp, maxModelLen or None, maxNumSeqs or None, weight)
    ("Qwen/Qwen2.5-0.5B-Instruct", 1, 4096, 16, 6),
    ("Qwen/Qwen2.5-1.5B-Instruct", 1, 8192, 8, 4),
    ("meta-llama/Llama-3.2-3B-Instruct", 1, 8192, 8, 4),
    ("meta-llama/Llama-3.1-8B-Instruct", 1, 8192, 8, 8),
    ("meta-llama/Llama-3.1-8B-Instruct", 1, None, 4, 2),
    ("Qwen/Qwen2.5-7B-Instruct", 1, 16384, 4, 6),
    ("mistralai/Mistral-7B-Instruct-v0.3", 1, 8192, 4, 4),
    ("Qwen/Qwen2.5-14B-Instruct", 1, 8192, 8, 3),
    ("Qwen/Qwen2.5-32B-Instruct", 2, 16384, 8, 2),
    ("meta-llama/Llama-3.1-70B-Instruct", 4, 16384, 8, 1),
    ("BAAI/bge-m3", 1, 8192, 32, 3),
)
GIB = 1 << 30


def cluster(n_nodes: int, rnd: random.Random) -> list[placement.NodeInfo]:
    choices = [p for p, w, _ in PRODUCTS for _ in range(w)]
    pools = {p: pool for p, _, pool in PRODUCTS}
    nodes = []
    for i in range(n_nodes):
        product = choices[i % len(choices)]
        gpu = catalog.gpu(product)
        name = f"node-{i:04d}"
        slots = tuple(
            placement.GpuSlot(name, g, gpu, foreign_bytes=(4 * GIB if rnd.random() < 0.05 else 0))
            for g in range(8)
        )
        nodes.append(
            placement.NodeInfo(name, {"pool": pools[product], defaults.GFD_PRODUCT_LABEL: product}, slots)
        )
    return nodes


def requests(n: int, n_nodes: int, rnd: random.Random, prefix: str = "d") -> list[placement.Request]:
    weighted = [m for m in MIX for _ in range(m[4])]
    out = []
    for i in range(n):
        model, tp, length, seqs, _ = rnd.choice(weighted)
        spec: dict = {"model": model, "tensorParallelSize": tp}
        if length:
            spec["maxModelLen"] = length
        if seqs:
            spec["maxNumSeqs"] = seqs
        r = rnd.random()
        if r < 0.10:
            spec["placement"] = {"nodeSelector": {"pool": "large"}}
        elif r < 0.15:
            spec["placement"] = {"nodeName": f"node-{rnd.randrange(n_nodes):04d}"}
        elif r < 0.20:
            spec["placement"] = {"policy": "spread"}
        key = f"ns{i % 50}/{prefix}{i:05d}"
        out.append(
            placement.Request(
                key,
                VLLMDeploymentSpec.model_validate(spec),
                catalog.model(model),
                (f"2025-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}Z", key),
            )
        )
    return out


def packing(p: placement.Plan) -> dict[str, int]:
    used = sum(1 for s in p.ledger.slots() if p.ledger.bookings_on(s.node, s.index))
    per_process = sum(len(r.gpus) for d in p.decisions.values() if d.admitted for r in d.replicas)
    demand: dict[str, int] = {}
    budget: dict[str, int] = {}
    for s in p.ledger.slots():
        booked = sum(b.footprint.total for b in p.ledger.bookings_on(s.node, s.index))
        demand[s.gpu.product] = demand.get(s.gpu.product, 0) + booked
        budget[s.gpu.product] = s.budget_bytes
    lower = sum(math.ceil(demand[k] / budget[k]) for k in demand)
    return {"gpus_used": used, "gpus_one_per_process": per_process, "gpus_lower_bound": lower}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--deployments", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--denials", type=int, default=20)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])

    nodes = cluster(args.nodes, random.Random(1))
    reqs = requests(args.deployments, args.nodes, random.Random(2))
    times, p = [], None
    for _ in range(args.rounds):
        t = time.perf_counter()
        p = placement.plan(nodes, reqs)
        times.append(time.perf_counter() - t)
    assert p is not None
    assert not p.ledger.over_budget(), "invariant broken"
    phases = [d.phase for d in p.decisions.values()]

    extra = requests(args.samples, args.nodes, random.Random(3), prefix="extra")
    lat = []
    admitted_extra = 0
    for r in extra:
        t = time.perf_counter()
        d = placement.decide(p.ledger, r)
        p.ledger.book(d)
        lat.append(time.perf_counter() - t)
        admitted_extra += d.admitted
        p.ledger.release(r.key)
    lat.sort()
    huge = placement.Request(
        "x/fits-nowhere",
        VLLMDeploymentSpec.model_validate(
            {"model": "meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 131072, "maxNumSeqs": 64}
        ),
        catalog.model("meta-llama/Llama-3.1-70B-Instruct"),
    )
    denied = []
    for _ in range(args.denials):
        t = time.perf_counter()
        d = placement.decide(p.ledger, huge)
        denied.append(time.perf_counter() - t)
        assert d.phase == "Unschedulable"
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    pack = packing(p)
    result = {
        "nodes": args.nodes,
        "gpus": args.nodes * 8,
        "deployments": args.deployments,
        "admitted": phases.count("Admitted"),
        "unschedulable": phases.count("Unschedulable"),
        "full_plan_s": round(statistics.median(times), 3),
        "admit_p50_ms": round(1000 * lat[len(lat) // 2], 3),
        "admit_p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
        "admit_max_ms": round(1000 * lat[-1], 3),
        "extra_admitted": admitted_extra,
        "denied_p50_ms": round(1000 * statistics.median(denied), 1) if denied else None,
        "peak_rss_mb": round(rss_mb, 1),
        **pack,
    }
    per_process = pack["gpus_one_per_process"] / max(pack["gpus_used"], 1)
    over_bound = pack["gpus_used"] / max(pack["gpus_lower_bound"], 1)
    rows = [
        ("cluster", f"{args.nodes} nodes x 8 GPUs, {args.deployments} deployments"),
        ("admitted / unschedulable", f"{result['admitted']} / {result['unschedulable']}"),
        (
            f"full plan (median of {args.rounds})",
            f"{result['full_plan_s']:.3f} s  (rounds: {', '.join(f'{x:.3f}' for x in times)})",
        ),
        (
            "one more admission p50 / p99 / max",
            f"{result['admit_p50_ms']:.3f} / {result['admit_p99_ms']:.3f} / {result['admit_max_ms']:.3f} ms"
            + f" ({args.samples} samples, {admitted_extra} fit)",
        ),
        (
            "a deployment that fits nowhere p50",
            f"{result['denied_p50_ms']} ms (grouped reasons, checked fixes)",
        ),
        ("peak RSS", f"{result['peak_rss_mb']:.0f} MB"),
        ("GPUs used", f"{pack['gpus_used']}"),
        (
            "  one GPU per process (device plugin)",
            f"{pack['gpus_one_per_process']}  ({per_process:.2f}x)",
        ),
        (
            "  lower bound (bytes / budget)",
            f"{pack['gpus_lower_bound']}  ({over_bound:.2f}x of it)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
