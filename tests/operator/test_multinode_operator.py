"""The operator and a replica larger than a node: without the LeaderWorkerSet CRD served (discovered
through the API at start-up) the spec is refused with that reason, and nothing is booked or written;
a one-node spec on the same nodes is admitted as before."""

from __future__ import annotations

import kmock
import pytest
from opkit import DEPLOYMENTS, Cluster, Operator, node, vd

from vllmfit.operator.handlers import startup

pytestmark = pytest.mark.looptime

LLAMA_405B = "meta-llama/Llama-3.1-405B-Instruct"
BIG = {"tensorParallelSize": 8, "pipelineParallelSize": 2, "maxModelLen": 32768, "kvCache": {"tokens": 131072}}


async def test_without_the_lws_crd_a_multi_node_spec_is_refused_with_that_reason(cluster: Cluster,
                                                                                operator: Operator) -> None:
    for n in ("h100-a", "h100-b"):
        await cluster.create(node(n, gpus=8))
    await cluster.create(vd("llama", LLAMA_405B, **BIG))
    st = await cluster.phase("llama", "Unschedulable")
    assert startup.NO_LWS in st["reasons"][0] and "leaderworkerset.x-k8s.io/v1" in st["reasons"][0]
    admitted = next(c for c in st["conditions"] if c["type"] == "Admitted")
    assert admitted["status"] == "False" and startup.NO_LWS in admitted["message"]
    # the checked fix: one node of fp8 weights (the 405B checkpoint is bf16)
    assert st["suggestions"] == ["quantization: fp8, pipelineParallelSize: 1"]
    assert st.get("memory") in (None, []) and cluster.get(DEPLOYMENTS, "llama-0") is None
    assert operator.store.books.ledger.bookings_of("default/llama") == []


async def test_with_the_lws_crd_the_refusal_names_the_operators_limit(km: kmock.KubernetesEmulator,
                                                                    cluster: Cluster) -> None:
    km.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = kmock.ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"})
    op = Operator(km)
    await op.start()
    try:
        for n in ("h100-a", "h100-b"):
            await cluster.create(node(n, gpus=8))
        await cluster.create(vd("llama", LLAMA_405B, **BIG))
        st = await cluster.phase("llama", "Unschedulable")
        assert startup.NO_LWS_WRITER in st["reasons"][0]
    finally:
        await op.stop()


def test_the_webhook_denies_it_with_the_same_reason_on_the_operators_snapshot() -> None:
    from vllmfit.core import placement
    from vllmfit.core.spec import api
    from vllmfit.operator.admission import verdict
    from vllmfit.sources import catalog

    led = placement.Ledger(placement.node_from_object(node(n, gpus=8), catalog.gpu_for_label)
                           for n in ("h100-a", "h100-b"))
    obj = api.VLLMDeployment.model_validate({"metadata": {"name": "llama", "namespace": "default"},
                                             "spec": {"model": LLAMA_405B, **BIG}})
    req = placement.request_from_object(obj, catalog.model(LLAMA_405B))
    ok = verdict.check(led.snapshot(), req)
    assert ok is not None and ok.allowed  # vllmfit plan's answer: it fits across the two nodes
    led.multi_node = startup.NO_LWS
    v = verdict.check(led.snapshot(), req)
    assert v is not None and not v.allowed and startup.NO_LWS in v.message
