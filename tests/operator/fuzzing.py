"""A fuzz of event orders against the real operator on KMock (issue 22): random creates, deletes,
scale-ups and -downs, moves (a pinned GPU changed), resizes (another context length and KV
capacity, mostly in place), node loss and return, operator restarts, and
random waits, with pods that take a random time to terminate (kubelet.py). The invariant, checked
at every tick of the kubelet: for every GPU, the sum over every pod that may be running on it is
within its budget, and no pod starts where no stored status books it.

Used by tests/operator/test_event_fuzz.py (a fixed seed, a few dozen steps) and by
benchmarks/event_fuzz.py (more seeds, longer runs)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import kmock
from kubelet import Kubelet, exists
from opkit import VD, Cluster, Emulator, Operator, node, vd

from vllmfit.core.spec import api

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
SIZES = ({"maxModelLen": 32768, "kvCache": {"concurrency": 16}}, {"maxModelLen": 8192}, {"maxModelLen": 4096})
NAMES = ("a", "b", "c", "d")
GPUS = 2


@dataclass
class Outcome:
    seed: int
    steps: int
    actions: dict[str, int]
    violations: list[str]
    pods_started: int
    restarts: int
    errors: list[str]


async def fuzz(seed: int, steps: int, *, restarts: bool = True, grace: float = 0.15) -> Outcome:
    rng = random.Random(seed)
    async with Emulator() as km, kmock.Server(km):
        km.resources.load_bundled()
        km.resources[VD] = kmock.ResourceInfo(
            kind=api.KIND, namespaced=True, singular=api.SINGULAR, shortnames=set(api.SHORT_NAMES),
            subresources={"status"}, verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
        cluster = Cluster(km)
        kubelet = Kubelet(Cluster(km), grace=grace, gpus={"gpu-a": GPUS})
        op = Operator(km)
        await op.start()
        kubelet.start()
        counts: dict[str, int] = {}
        started = 0
        n_restarts = 0
        node_up = True
        try:
            await cluster.create(node("gpu-a", gpus=GPUS))
            for _ in range(steps):
                kind = rng.choice(["create"] * 4 + ["delete", "scale", "scale", "move", "move", "resize", "resize", "node", "wait",
                                                    "wait"]
                                  + (["restart"] if restarts else []))
                alive = [n for n in NAMES if exists(cluster, n)]
                name = rng.choice([n for n in NAMES if n not in alive] or NAMES) if kind == "create" \
                    else rng.choice(alive or NAMES)
                live = exists(cluster, name)
                try:
                    if kind == "create" and not live:
                        spec: dict[str, Any] = dict(rng.choice(SIZES))
                        if rng.random() < 0.3:
                            spec["placement"] = {"nodeName": "gpu-a", "gpuIndices": [rng.randrange(GPUS)]}
                        spec["replicas"] = rng.choice([1, 1, 2])
                        await cluster.create(vd(name, QWEN7, **spec))
                    elif kind == "delete" and live:
                        await cluster.delete(name)
                    elif kind == "scale" and live:
                        await cluster.patch_spec(name, {"replicas": rng.choice([0, 1, 2])})
                    elif kind == "move" and live:
                        await cluster.patch_spec(name, {"replicas": 1, "placement": {
                            "nodeName": "gpu-a", "gpuIndices": [rng.randrange(GPUS)]}})
                    elif kind == "resize" and live:
                        # a merge patch: the kvCache of a size that names none is vd()'s default
                        await cluster.patch_spec(name, {"kvCache": {"concurrency": 1}, **rng.choice(SIZES)})
                    elif kind == "node":
                        if node_up:
                            await cluster.delete_node("gpu-a")
                        else:
                            await cluster.create(node("gpu-a", gpus=GPUS))
                        node_up = not node_up
                    elif kind == "restart":
                        await op.stop()
                        await cluster.reconnect()
                        await op.start()
                        await kubelet.ensure()
                        n_restarts += 1
                    else:
                        kind = "wait"
                except Exception as e:  # noqa: BLE001 - a conflict with the operator's own write: a lost step
                    kind = f"{kind} failed ({type(e).__name__})"
                counts[kind] = counts.get(kind, 0) + 1
                await asyncio.sleep(rng.choice([0.0, 0.02, 0.1, 0.3]))
                if kubelet.violations:
                    break
            if not node_up:
                await cluster.create(node("gpu-a", gpus=GPUS))
            await asyncio.sleep(1.0)  # settle: every pod that stops is gone, every booking written
        finally:
            started = kubelet.started
            await kubelet.stop()
            await op.stop()
            await cluster.api.close()
        return Outcome(seed, steps, counts, list(kubelet.violations), started, n_restarts, kubelet.errors[:3])
