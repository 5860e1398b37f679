"""Sharing with the caps vLLM users write: GPUs used against the bin-packing lower bound.

A seeded stream of specs as users write them (no kvCache; maxNumSeqs 16-256, maxModelLen 4k-32k,
common catalog models from 0.5B to 8B, a few 14B and a 70B fp8 at tensorParallelSize 2) onto a
cluster of H100 nodes with 8 GPUs each, placed two ways:

- `plan`: core.placement.plan of the whole stream (what `vllmfit plan` does);
- one by one: decide + book in arrival order, as the webhook and the operator admit them; and the
  same stream in reverse arrival order.

Measured per way: deployments admitted, GPUs in use, the lower bound (every spec's KV request, two
full-length requests at most maxNumSeqs, as `kvCache.concurrency`: total bytes / one GPU's budget,
rounded up, per replica's GPUs), the KV tokens granted (median), and the specs granted fewer than
one full-length request or more than maxNumSeqs x maxModelLen (both must be 0).

Run it on another tree to compare (the "before" of a change): PYTHONPATH=/path/to/other/operator.

    .venv/bin/python benchmarks/fair_share.py [--specs 300] [--nodes 12] [--seed 1] [--quick]

Prints a table, then as its LAST line one JSON object whose keys end in their units.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics

from vllmfit.core import memory, placement
from vllmfit.core.spec.api import VLLMDeploymentSpec
from vllmfit.sources import catalog

H100 = "NVIDIA-H100-80GB-HBM3"
MODELS = [  # (model, weight in the stream, extra spec fields)
    ("Qwen/Qwen2.5-0.5B-Instruct", 3, {}),
    ("Qwen/Qwen2.5-1.5B-Instruct", 4, {}),
    ("meta-llama/Llama-3.2-1B-Instruct", 4, {}),
    ("microsoft/Phi-3-mini-4k-instruct", 2, {}),
    ("Qwen/Qwen2.5-7B-Instruct", 4, {}),
    ("meta-llama/Llama-3.1-8B-Instruct", 5, {}),
    ("Qwen/Qwen2.5-14B-Instruct", 1, {}),
    ("meta-llama/Llama-3.1-70B-Instruct", 1, {"quantization": "fp8", "tensorParallelSize": 2}),
]
SEQS = [16, 32, 64, 128, 256]
LENGTHS = [4096, 8192, 16384, 32768]


def stream(n: int, rng: random.Random) -> list[placement.Request]:
    """n specs as users write them: a model, maxModelLen and maxNumSeqs, nothing else."""
    names = [m for m, _, _ in MODELS]
    weights = [w for _, w, _ in MODELS]
    extra = {m: e for m, _, e in MODELS}
    out = []
    for i in range(n):
        model = rng.choices(names, weights)[0]
        arch = catalog.model(model)
        spec = {"model": model, "maxNumSeqs": rng.choice(SEQS),
                "maxModelLen": min(rng.choice(LENGTHS), arch.max_model_len), **extra[model]}
        out.append(placement.Request(f"s/spec-{i:04d}", VLLMDeploymentSpec.model_validate(spec), arch,
                                     ("", f"{i:06d}")))
    return out


def nodes(count: int) -> list[placement.NodeInfo]:
    gpu = catalog.gpu(H100)
    return [placement.NodeInfo(f"node-{i:03d}", {}, tuple(placement.GpuSlot(f"node-{i:03d}", j, gpu) for j in range(8)))
            for i in range(count)]


def request_bytes(r: placement.Request) -> int:
    """Bytes per GPU of the spec's KV request (two full-length requests, at most maxNumSeqs), sized
    alone with a fixed KV request (kvCache.concurrency): the same on either tree."""
    spec = r.spec
    s = memory.Settings(tp=spec.tensor_parallel_size, quantization=spec.quantization, max_model_len=spec.max_model_len,
                        max_num_seqs=spec.max_num_seqs, kv_concurrency=min(2, spec.max_num_seqs or 2))
    return memory.size(r.model, s, catalog.gpu(H100), memory.UNLIMITED).footprint.total


def limit_bytes(r: placement.Request, f: memory.Flags) -> int:
    """maxNumSeqs requests of maxModelLen as vLLM pages them (whole blocks per KV group) + the null block."""
    s = memory.Settings(tp=r.spec.tensor_parallel_size, quantization=r.spec.quantization)
    gpu = catalog.gpu(H100)
    lay = memory.kv_layout(r.model, s, memory.parse_version(s.vllm_version)[0], gpu)
    return lay.bytes_for(f.max_model_len, f.max_num_seqs, f.max_num_batched_tokens or 0)


def measure(decisions: dict[str, placement.Decision], ledger: placement.Ledger, reqs: list[placement.Request],
            budget: int) -> dict[str, float]:
    admitted = [d for d in decisions.values() if d.admitted]
    used = {(b.node, b.index) for d in admitted for b in d.bookings()}
    lower = math.ceil(sum(request_bytes(r) * r.spec.tensor_parallel_size for r in reqs) / budget)
    tokens = [d.replicas[0].sizing.granted_tokens for d in admitted]
    below = beyond = 0
    by_key = {r.key: r for r in reqs}
    for d in admitted:
        z = d.replicas[0].sizing
        f = z.flags
        if z.max_concurrency < 1:
            below += 1
        if f is not None and z.footprint.kv_cache > limit_bytes(by_key[d.key], f):
            beyond += 1
    return {"admitted": len(admitted), "refused": len(decisions) - len(admitted), "gpus": len(used),
            "lower": lower, "tokens": statistics.median(tokens) if tokens else 0, "below": below, "beyond": beyond}


def one_by_one(ns: list[placement.NodeInfo], reqs: list[placement.Request]) -> tuple[dict, placement.Ledger]:
    ledger = placement.Ledger(ns)
    out = {}
    for r in reqs:
        out[r.key] = d = placement.decide(ledger, r, suggest=False)
        ledger.book(d)
    return out, ledger


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--specs", type=int, default=300)
    p.add_argument("--nodes", type=int, default=12)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="40 specs on 2 nodes")
    args = p.parse_args()
    if args.quick:
        args.specs, args.nodes = 40, 2
    reqs = stream(args.specs, random.Random(args.seed))
    budget = memory.DEFAULT_POLICY.budget(catalog.gpu(H100).cuda_total_bytes)
    ns = nodes(args.nodes)
    planned = placement.plan(ns, reqs, suggest=False)
    ways = {"plan": measure(planned.decisions, planned.ledger, reqs, budget)}
    decided, ledger = one_by_one(ns, reqs)
    ways["one_by_one"] = measure(decided, ledger, reqs, budget)
    decided, ledger = one_by_one(ns, list(reversed(reqs)))
    ways["reversed"] = measure(decided, ledger, reqs, budget)
    print(f"{args.specs} specs (no kvCache; maxNumSeqs 16-256, maxModelLen 4k-32k) on {args.nodes} nodes x 8 H100")
    print(f"{'way':<12} {'admitted':>8} {'refused':>8} {'GPUs used':>10} {'lower bound':>12} "
          f"{'KV tokens (median)':>19} {'< 1 request':>12} {'> caps':>7}")
    for way, m in ways.items():
        print(f"{way:<12} {m['admitted']:>8} {m['refused']:>8} {m['gpus']:>10} {m['lower']:>12} "
              f"{m['tokens']:>19,.0f} {m['below']:>12} {m['beyond']:>7}")
    result: dict[str, float] = {"specs_count": args.specs, "nodes_count": args.nodes}
    for way, m in ways.items():
        result.update({f"{way}_admitted_count": m["admitted"], f"{way}_refused_count": m["refused"],
                       f"{way}_gpus_used_count": m["gpus"], f"{way}_lower_bound_gpus_count": m["lower"],
                       f"{way}_median_kv_tokens_count": m["tokens"], f"{way}_below_one_request_count": m["below"],
                       f"{way}_beyond_caps_count": m["beyond"]})
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
