"""One node agent's report at fleet size: the operator's CPU per report.

Every node's agent (vllmfit.agent) publishes its GPU inventory on its Node every sampling period
(30 s by default) when it changed; the operator's node handler (`handlers.nodes.on_node`) reads it:
the node's GPUs and foreign use, which processes are vllmfit's pods, what each replica measures
(the closed loop), over-budget checks. At 10,000 nodes reporting every 30 s that is 333 reports a
second, so a report must cost well under 3 ms of CPU, whatever the fleet's size.

The operator's state is built in-process as the operator holds it (`booking.state.Store`): nodes
x 8 H100 read from GFD labels and an agent inventory, deployments decided and booked by the
operator's own `apply_decision`, each replica with a ready pod whose UID the records know. Then
`--reports` nodes (spread over the fleet) each report an inventory whose processes are the pods
booked there, using what was predicted; each is reported twice and the second report, the steady
state, is timed: the CPU of `on_node` (its API writes, `finish`, the learned-record save and the
reservation gates, are left out: they are the same whatever the fleet's size). Prints a table,
then as its last line one JSON object whose keys end in their units.

    .venv/bin/python benchmarks/node_report.py                                 # 1,000 nodes, 4,000 deployments
    .venv/bin/python benchmarks/node_report.py --nodes 10000 --deployments 40000   # fleet size, ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))

import kopf
from opkit import node

from vllmfit.core import defaults, placement
from vllmfit.core.observe import inventory
from vllmfit.core.spec import read
from vllmfit.operator.booking.pods import PodHealth
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers import nodes
from vllmfit.operator.handlers.common import Effects
from vllmfit.operator.handlers.decide import apply_decision
from vllmfit.sources import catalog

H100 = "NVIDIA-H100-80GB-HBM3"
MIX = [
    {"model": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192, "maxNumSeqs": 16},
    {"model": "Qwen/Qwen2.5-7B-Instruct", "maxModelLen": 16384, "maxNumSeqs": 8},
    {"model": "Qwen/Qwen2.5-1.5B-Instruct", "maxModelLen": 8192, "maxNumSeqs": 8},
    {"model": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 32768, "maxNumSeqs": 8},
]


def body(name: str, processes: dict[int, list[tuple[str, int]]] | None = None) -> dict[str, Any]:
    """A Node with GFD labels and the agent's inventory (processes: GPU -> (pod UID, bytes))."""
    total = catalog.gpu(H100).memory_bytes
    gpus = [inventory.InventoryGpu(
        index=i, uuid=f"GPU-{name}-{i}", product=H100, total_bytes=total,
        used_bytes=sum(b for _, b in (processes or {}).get(i, [])),
        processes=[inventory.InventoryProcess(pid=1000 + j, used_bytes=b, pod_uid=u)
                   for j, (u, b) in enumerate((processes or {}).get(i, []))]) for i in range(8)]
    inv = inventory.GpuInventory(sampled_at=datetime.now(UTC).isoformat(), gpus=gpus)
    return node(name, 8, H100, {defaults.INVENTORY_ANNOTATION: inv.model_dump_json()})


async def build(n_nodes: int, n_deployments: int) -> tuple[Store, dict[str, dict[str, Any]], float]:
    t = time.perf_counter()
    store = Store()
    infos = [nodes.node_info(body(f"gpu-node-{i:05d}"), {}, None, policy=store.options.budget)
             for i in range(n_nodes)]
    store.books.ledger = placement.Ledger(infos, kv_grant=store.options.kv_grant)
    store.cache.node_infos = {i.name: i for i in infos}
    seen = getattr(store.cache, "pod_seen", None)  # the code before issue 32's node path: records only
    pods: dict[str, dict[str, Any]] = {}  # uid -> (key, replica) of each booked replica's pod
    for i in range(n_deployments):
        spec = MIX[i % len(MIX)]
        obj = {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment",
               "metadata": {"name": f"d{i:05d}", "namespace": f"team-{i % 20}", "uid": f"vd-{i}", "generation": 1},
               "spec": dict(spec)}
        req = placement.request_from_object(read.deployment(obj), catalog.model(spec["model"]))
        d = placement.decide(store.books.ledger, req)
        rec = store.cache.upsert(obj)
        with getattr(store.books, "step", contextlib.nullcontext)():  # the one writer (older code: none)
            apply_decision(store, rec, req, d, Effects())
        for p in rec.placement:
            pod, uid = f"d{i:05d}-{p.replica}-x", f"pod-{i}-{p.replica}"
            rec.pods[pod] = (p.replica, PodHealth(True, "Ready", ""))
            if seen is not None:
                seen(rec, pod, uid)
            else:
                rec.pod_uids[pod] = uid
            pods[uid] = {"key": rec.key, "replica": p.replica}
    async with store.books.changing():  # publish the committed snapshot, as a handler's section does
        pass
    store.books.ready.set()
    return store, pods, time.perf_counter() - t


def report_of(store: Store, name: str, pods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The node's inventory: a process per replica booked there, using what was predicted."""
    by_replica = {(v["key"], v["replica"]): uid for uid, v in pods.items()}
    processes: dict[int, list[tuple[str, int]]] = {}
    for key in store.books.ledger.deployments_on(name):
        for b in store.books.ledger.bookings_of(key):
            if b.node == name and (uid := by_replica.get((key, b.replica))):
                processes.setdefault(b.index, []).append((uid, b.footprint.predicted))
    return body(name, processes)


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    store, pods, build_s = await build(a.nodes, a.deployments)
    gc.collect()
    gc.freeze()  # as the operator does after its rebuild (booking/state.py)

    async def nothing(*_: Any, **__: Any) -> None:
        return None

    nodes.finish, nodes.learning.save, nodes.reservations.ungate = nothing, nothing, nothing  # API writes: out
    memo = kopf.Memo(store=store)
    names = [f"gpu-node-{i:05d}" for i in range(0, a.nodes, max(a.nodes // a.reports, 1))][: a.reports]
    cpu: list[float] = []
    for name in names:
        await nodes.on_node(type="MODIFIED", body=report_of(store, name, pods), memo=memo)  # the first of these processes
        b = report_of(store, name, pods)  # the next sample: the same use, sampled later
        c = time.process_time()
        await nodes.on_node(type="MODIFIED", body=b, memo=memo)  # the steady state: timed
        cpu.append(time.process_time() - c)
    q = statistics.quantiles(cpu, n=100, method="inclusive")
    booked = sum(len(store.books.ledger.bookings_of(k)) for k in store.books.ledger.deployments())
    return {"nodes_count": a.nodes, "deployments_count": a.deployments, "replicas_booked_count": booked,
            "reports_count": len(cpu), "build_s": round(build_s, 1),
            "report_cpu_p50_ms": round(q[49] * 1e3, 3), "report_cpu_p99_ms": round(q[98] * 1e3, 3),
            "report_cpu_max_ms": round(max(cpu) * 1e3, 3),
            "reports_per_core_per_s": round(1 / statistics.median(cpu), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--deployments", type=int, default=4000)
    ap.add_argument("--reports", type=int, default=100, help="nodes that report (each twice; the second is timed)")
    ap.add_argument("--quick", action="store_true", help="20 nodes, 40 deployments, 10 reports: does it run")
    a = ap.parse_args()
    if a.quick:
        a.nodes, a.deployments, a.reports = 20, 40, 10
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    logging.basicConfig(level=logging.ERROR)
    r = asyncio.run(main_async(a))
    print(f"{'nodes x 8 H100':<34}{r['nodes_count']:>12,}")
    print(f"{'deployments (replicas booked)':<34}{r['deployments_count']:>12,} ({r['replicas_booked_count']:,})")
    print(f"{'build (s)':<34}{r['build_s']:>12}")
    print(f"{'one report, CPU p50 / p99 / max':<34}{r['report_cpu_p50_ms']:>9.3f} / {r['report_cpu_p99_ms']:.3f} / "
          f"{r['report_cpu_max_ms']:.3f} ms ({r['reports_count']} reports)")
    print(f"{'reports one core handles':<34}{r['reports_per_core_per_s']:>12,.1f} /s")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
