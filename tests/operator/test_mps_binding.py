"""Issue 30: the optional MPS binding on the emulator. With --mps-pipe-directory set, the running
operator (KMock) writes every sharing replica's Deployment with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT equal
to what it booked on its GPU (the pod's vllmfit.dev/booked bytes, in MiB rounded down) and the MPS
directories mounted; off (the default), nothing of it. No GPU is lent here: MPS refusing the process
memory beyond that limit is not shown (docs/placement-backends.md, "Enforcement")."""

from __future__ import annotations

from typing import Any

import pytest
from opkit import DEPLOYMENTS, Cluster, node, vd

from vllmfit.backends import binding
from vllmfit.core import defaults
from vllmfit.operator.rendering import builders

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"


def vllm_env(d: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("on", [True, False], ids=["mps", "off"])
async def test_sharing_replicas_get_their_booking_as_the_mps_limit(cluster: Cluster, operator: Any, on: bool) -> None:
    store = cluster.store
    store.options.mps = binding.Mps() if on else None
    try:
        await cluster.create(node("gpu-a", gpus=1))
        # one after the other: a replica alone on its GPU is written with device-plugin limits and
        # keeps them once a neighbour comes (no restart); created together, whether `a` was
        # written before `b` was booked was a race (decided by how fast the writes are)
        await cluster.create(vd("a", QWEN7, maxModelLen=4096))
        await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
        await cluster.create(vd("b", QWEN7, maxModelLen=8192))
        await cluster.phase("a", "Admitted")
        await cluster.phase("b", "Admitted")
        await cluster.until(lambda: cluster.get(DEPLOYMENTS, "b-0"))
        a0 = cluster.get(DEPLOYMENTS, "a-0")
        assert a0["metadata"]["annotations"][builders.ANNOTATION_PINNING] == binding.PIN_DEVICE_PLUGIN
        assert not [k for k in vllm_env(a0) if k.startswith("CUDA_MPS_")]  # not sharing: no MPS limit
        for name in ("b",):
            d = cluster.get(DEPLOYMENTS, f"{name}-0")
            booked = d["spec"]["template"]["metadata"]["annotations"][builders.ANNOTATION_BOOKED]
            [(_index, nbytes)] = [part.split("=") for part in booked.split(",")]
            assert int(nbytes) == sum(m["totalBytes"] for m in cluster.status(name)["memory"])  # one GPU
            env = vllm_env(d)
            if on:
                assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={int(nbytes) // defaults.MIB}M"
                assert env["CUDA_MPS_PIPE_DIRECTORY"] == defaults.MPS_PIPE_DIRECTORY
                mounts = d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                assert {"name": binding.MPS_PIPE_VOLUME, "mountPath": defaults.MPS_PIPE_DIRECTORY} in mounts
            else:
                assert not [k for k in env if k.startswith("CUDA_MPS_")]
    finally:
        store.options.mps = None
