"""The `vllmfit plan --output json` contract (docs/placement.md): byte-for-byte deterministic."""

from __future__ import annotations

import json
from typing import Any

from vllmfit.core import memory
from vllmfit.core.placement.plan import Plan


def to_json(p: Plan) -> str:
    """The `vllmfit plan --output json` contract (docs/placement.md): byte-for-byte deterministic."""
    gpus = []
    for sl in p.ledger.slots():
        segments = []
        for b in p.ledger.bookings_on(sl.node, sl.index):
            fp = b.footprint
            for comp, val in (
                ("weights", fp.weights),
                ("kv_cache", fp.kv_cache),
                ("activation", fp.activation),
                ("overhead", fp.overhead),
            ):
                segments.append(
                    {"deployment": b.deployment, "replica": b.replica, "component": comp, "bytes": val}
                )
        gpus.append(
            {
                "node": sl.node,
                "index": sl.index,
                "label": sl.label,
                "uuid": sl.uuid,
                "product": sl.gpu.product,
                "mig": sl.mig,
                "capacity_bytes": sl.capacity_bytes,
                "budget_bytes": sl.budget_bytes,
                "reserve_bytes": sl.capacity_bytes - sl.budget_bytes,
                "used_bytes": p.ledger.used_bytes(sl.node, sl.index),
                "foreign_bytes": sl.foreign_bytes,
                "headroom_bytes": p.ledger.headroom_bytes(sl.node, sl.index),
                "segments": segments,
            }
        )
    deployments = [_deployment_json(p, key) for key in sorted(p.decisions)]
    phases = [d.phase for d in p.decisions.values()]
    summary = {
        "nodes": len(p.ledger.nodes),
        "gpus": len(gpus),
        "deployments": len(deployments),
        "admitted": phases.count("Admitted"),
        "unschedulable": phases.count("Unschedulable"),
        "rejected": phases.count("Rejected"),
        "errors": len(p.errors),
        "gpus_used": sum(1 for g in gpus if g["segments"]),
        "over_budget": len(p.ledger.over_budget()),
    }
    return json.dumps(
        {
            "summary": summary,
            "gpus": gpus,
            "deployments": deployments,
            "errors": sorted(p.errors),
            "warnings": sorted(p.warnings),
        },
        indent=2,
        sort_keys=True,
    )


def _deployment_json(p: Plan, key: str) -> dict[str, Any]:
    d = p.decisions[key]
    req = p.requests.get(key)
    r0 = d.replicas[0] if d.replicas else None
    fp = r0.sizing.footprint if r0 else None
    f = d.flags
    return {
        "name": key,
        "model": req.model.name if req else None,
        "phase": d.phase,
        "kept": d.restored,
        "moved": d.moved,
        "message": d.message,
        "node": r0.node if r0 else None,
        "gpus": list(r0.gpus) if r0 else [],
        "replicas": [
            {
                "replica": r.replica,
                "node": r.node,
                "gpus": list(r.gpus),
                "gpu_memory_utilization": r.sizing.flags.gpu_memory_utilization if r.sizing.flags else None,
                "total_bytes": [r.footprint_on(i).total for i in range(len(r.gpus))],
                **({"workers": [  # a replica across nodes: its other pods (the leader is node and gpus)
                    {"node": m.node, "gpus": list(m.gpus), "total_bytes": [fp.total for fp in m.footprints],
                     "weights_bytes": [fp.weights for fp in m.footprints],
                     "kv_cache_bytes": [fp.kv_cache for fp in m.footprints]}
                    for m in r.workers]} if r.workers else {}),
            }
            for r in d.replicas
        ],
        "flags": None if f is None else f.to_json(),
        "per_gpu": None
        if fp is None
        else {
            "weights_bytes": fp.weights,
            "kv_cache_bytes": fp.kv_cache,
            "activation_bytes": fp.activation,
            "overhead_bytes": fp.overhead,
            "total_bytes": fp.total,
        },
        "kv_cache_tokens": r0.sizing.kv_cache_tokens if r0 and not d.restored else None,
        "max_concurrency": round(r0.sizing.max_concurrency, 2) if r0 and not d.restored else None,
        "kv_cache": None if r0 is None or d.restored else memory.kv_json(r0.sizing),  # what status.kvCache shows
        "reasons": list(d.reasons),
        "suggestions": list(d.suggestions),
        "warnings": list(d.warnings),
    }
