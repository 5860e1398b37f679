"""The operator and a replica larger than a node: without the LeaderWorkerSet CRD served (discovered
through the API at start-up) the spec is refused with that reason, and nothing is booked or written.
With it served, the replica runs as one LeaderWorkerSet with the flags `plan` computes, its GPUs
booked in one step and released when the group's pods are gone; a lost worker places it again."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest
from opkit import DEPLOYMENTS, PODS, Cluster, Operator, budget, node, vd

from vllmfit.core import placement
from vllmfit.core.spec import api
from vllmfit.operator.handlers import startup
from vllmfit.operator.handlers.writes import settle_drains
from vllmfit.operator.rendering import builders, lws
from vllmfit.sources import catalog

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


LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"


@pytest.fixture
async def lws_operator(km: kmock.KubernetesEmulator) -> AsyncIterator[Operator]:
    """The operator on a cluster that serves LeaderWorkerSets (the CRD registered before it starts)."""
    km.resources[LWS] = kmock.ResourceInfo(kind="LeaderWorkerSet", namespaced=True,
                                           verbs={"get", "list", "watch", "create", "patch", "delete"})
    op = Operator(km)
    await op.start()
    yield op
    await op.stop()


def planned(nodes: list[str]) -> placement.Decision:
    """What `vllmfit plan` decides for the spec on these empty nodes (the core, no operator)."""
    infos = [placement.node_from_object(node(n, gpus=8), catalog.gpu_for_label) for n in nodes]
    obj = api.VLLMDeployment.model_validate({"metadata": {"name": "llama", "namespace": "default"},
                                             "spec": {"model": LLAMA_405B, **BIG}})
    d = placement.plan(infos, [placement.request_from_object(obj, catalog.model(LLAMA_405B))]).decisions["default/llama"]
    assert d.admitted and d.flags is not None
    return d


async def group_pods(cluster: Cluster, lws_name: str) -> list[str]:
    """The pods the LeaderWorkerSet controller would create (leader, then worker), as the kubelet runs them."""
    obj = await cluster.until(lambda: cluster.get(LWS, lws_name), what=f"LeaderWorkerSet {lws_name}")
    t = obj["spec"]["leaderWorkerTemplate"]
    names = []
    for k, tpl in enumerate((t["leaderTemplate"], t["workerTemplate"])):
        name = f"{lws_name}-{k}" if k else lws_name
        node_name = tpl["metadata"]["annotations"][builders.ANNOTATION_PLACEMENT].split(":")[0]
        await cluster.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4()), "resourceVersion": "1",
                         "labels": {**tpl["metadata"]["labels"], "leaderworkerset.sigs.k8s.io/name": lws_name},
                         "annotations": dict(tpl["metadata"]["annotations"]),
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": lws_name,
                                              "uid": str(uuid.uuid4()), "controller": True}]},
            "spec": {"nodeName": node_name, "containers": tpl["spec"]["containers"]},
            "status": {"phase": "Running"},
        })
        names.append(name)
    return names


def used(store: Any, nodes: list[str]) -> dict[str, int]:
    return {n: sum(store.books.committed.used_bytes(n, i) for i in range(8)) for n in nodes}


async def test_a_replica_across_nodes_runs_as_one_leader_worker_set_with_plans_flags(
        cluster: Cluster, lws_operator: Operator) -> None:
    nodes = ["h100-a", "h100-b"]
    for n in nodes:
        await cluster.create(node(n, gpus=8))
    journal = len(cluster.km.journal)
    await cluster.create(vd("llama", LLAMA_405B, **BIG))
    st = await cluster.phase("llama", "Admitted", "Running")
    d = planned(nodes)
    (r,) = d.replicas
    # one LeaderWorkerSet, no Deployment: the leader runs vllm serve with plan's flags, the worker joins it
    assert cluster.get(DEPLOYMENTS, "llama-0") is None and [o["metadata"]["name"] for o in cluster.objects(LWS)] == [
        "llama-0"]
    m = cluster.get(LWS, "llama-0")
    t = m["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2 and m["metadata"]["ownerReferences"][0]["name"] == "llama"
    leader, worker = t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]
    assert leader["containers"][0]["args"] == [*builders.vllm_args(api.VLLMDeploymentSpec.model_validate(
        {"model": LLAMA_405B, **BIG}), LLAMA_405B, d.flags), "--distributed-executor-backend=ray"]
    assert [a for a in leader["containers"][0]["args"] if a.startswith("--max-model-len")] == ["--max-model-len=32768"]
    assert worker["containers"][0]["args"] == [] and worker["containers"][0]["command"][2] == lws.WORKER_SCRIPT
    term = worker["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term[0]["matchFields"][0]["values"] == [r.workers[0].node]
    # all 16 GPUs booked, with plan's per-GPU figures, and no status ever showed part of the group
    book = lws_operator.store.books.committed.bookings_of("default/llama")
    assert sorted((b.node, b.index, b.footprint.total) for b in book) == sorted(
        (b.node, b.index, b.footprint.total) for b in d.bookings())
    assert len(book) == 16 and {b.node for b in book} == set(nodes)
    assert len(st["memory"]) == 16 and {(g["node"], g["index"]) for g in st["memory"]} == {
        (n, i) for n in nodes for i in range(8)}
    (p,) = st["placement"]
    assert (p["node"], [w["node"] for w in p["workers"]]) == (r.node, [r.workers[0].node])
    assert st["node"] == f"{r.node},{r.workers[0].node}" and st["gpuList"] == "0,1,2,3,4,5,6,7+0,1,2,3,4,5,6,7"
    statuses = [((q.data or {}).get("status") or {}).get("memory") for q in list(cluster.km.journal)[journal:]
                if str(q.method).upper().endswith("PATCH") and "/status" in str(q.url)]
    assert {len(s) for s in statuses if s} == {16}
    # the metrics: the group is replica 0 of llama on each GPU of both nodes, with plan's figures
    from vllmfit.operator.metrics import StoreCollector

    (fam,) = [f for f in StoreCollector(lws_operator.store).collect() if f.name == "vllmfit_deployment_predicted_bytes"]
    assert sorted((x.labels["replica"], x.labels["node"], int(x.labels["gpu"]), x.value) for x in fam.samples
                  if x.labels["name"] == "llama") == sorted(("0", b.node, b.index, b.footprint.total) for b in d.bookings())

    # deleted: the group's memory stays booked until both of its pods are gone
    pods = await group_pods(cluster, "llama-0")
    await cluster.delete("llama")
    await cluster.until(lambda: cluster.get(LWS, "llama-0") is None, what="the LeaderWorkerSet deleted")
    await cluster.until(lambda: any(x.stopped for x in lws_operator.store.books.drains.values()), what="a drain")
    await settle_drains(lws_operator.store)
    budget_all = {n: 8 * budget() for n in nodes}
    assert all(0 < v <= budget_all[n] for n, v in used(lws_operator.store, nodes).items())
    await cluster.core.delete_namespaced_pod(pods[0], "default")  # the leader goes first: the worker still holds
    await settle_drains(lws_operator.store)
    assert used(lws_operator.store, nodes)[r.workers[0].node] > 0
    await cluster.core.delete_namespaced_pod(pods[1], "default")
    await settle_drains(lws_operator.store)
    await cluster.until(lambda: used(lws_operator.store, nodes) == {n: 0 for n in nodes}, what="the group released")


async def test_a_lost_worker_places_the_group_again(cluster: Cluster, lws_operator: Operator) -> None:
    for n in ("h100-a", "h100-b", "h100-c"):
        await cluster.create(node(n, gpus=8))
    await cluster.create(vd("llama", LLAMA_405B, **BIG))
    st = await cluster.phase("llama", "Admitted", "Running")
    (p,) = st["placement"]
    lost = p["workers"][0]["node"]
    await cluster.delete_node(lost)
    await cluster.until(lambda: (cluster.status("llama").get("placement") or [{}])[0].get("workers", [{}])[0].get(
        "node") not in (lost, None), what="the group placed again")
    (q,) = cluster.status("llama")["placement"]
    now = {q["node"], q["workers"][0]["node"]}
    assert lost not in now and len(now) == 2
    assert {g["node"] for g in cluster.status("llama")["memory"]} == now
    assert len(cluster.status("llama")["memory"]) == 16
    m = cluster.get(LWS, "llama-0")
    assert m["metadata"]["annotations"][builders.ANNOTATION_PLACEMENT] == " + ".join(
        f"{n}:0,1,2,3,4,5,6,7" for n in sorted(now))
    w = m["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["affinity"]["nodeAffinity"]
    assert w["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchFields"][0][
        "values"] == [q["workers"][0]["node"]]
    assert {b.node for b in lws_operator.store.books.committed.bookings_of("default/llama")} == now


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


async def test_a_restart_rebuilds_the_groups_bookings_from_its_status_and_its_leader_worker_set(
        km: kmock.KubernetesEmulator, cluster: Cluster, lws_operator: Operator) -> None:
    nodes = ["h100-a", "h100-b"]
    for n in nodes:
        await cluster.create(node(n, gpus=8))
    await cluster.create(vd("llama", LLAMA_405B, **BIG))
    await cluster.phase("llama", "Admitted", "Running")
    before = sorted((b.node, b.index, b.footprint.total)
                    for b in lws_operator.store.books.committed.bookings_of("default/llama"))
    pods = await group_pods(cluster, "llama-0")
    written = cluster.get(LWS, "llama-0")
    await lws_operator.stop()
    journal = len(cluster.km.journal)
    op = Operator(km)  # a new process: the ledger comes back from the status and the LeaderWorkerSet
    await op.start()
    try:
        await cluster.until(lambda: op.store.books.committed.bookings_of("default/llama"), what="bookings rebuilt")
        assert sorted((b.node, b.index, b.footprint.total)
                      for b in op.store.books.committed.bookings_of("default/llama")) == before
        assert not op.store.books.drains  # the group's two pods are covered by the booking, leader and worker
        assert cluster.get(LWS, "llama-0")["spec"] == written["spec"]  # not swept, the same group
        assert not [q for q in list(cluster.km.journal)[journal:]
                    if str(q.method).upper().endswith("DELETE") and "leaderworkersets" in str(q.url)]
        assert {p["metadata"]["name"] for p in cluster.objects(PODS)} >= set(pods)
    finally:
        await op.stop()


def test_a_groups_drain_is_held_by_each_of_its_pods_until_both_are_gone() -> None:
    """Pure: the bookings of a replica across nodes as one placement ("a:0,1 + b:0,1", the text the
    LeaderWorkerSet carries); each pod carries its own node's part; the drain ends when no pod of
    either node is left, and at start-up neither pod of a booked group is taken for a stopped one."""
    from vllmfit.core.memory import Footprint
    from vllmfit.core.placement import Booking
    from vllmfit.operator.booking import draining

    gib = 1 << 30
    key = "default/llama"
    infos = [placement.node_from_object(node(n, gpus=2), catalog.gpu_for_label) for n in ("a", "b")]
    led = placement.Ledger(infos)
    group = [Booking(key, 0, n, i, Footprint(30 * gib, 0, 0, 0, 0, 0)) for n in ("b", "a") for i in (1, 0)]
    assert draining.where_of(group) == "a:0,1 + b:0,1"
    pod_pl = api.ReplicaPlacement(replica=0, node="a", gpus=[api.GpuRef(index=0), api.GpuRef(index=1)],
                                  workers=[api.PodPlacement(node="b", gpus=[api.GpuRef(index=0), api.GpuRef(index=1)])])
    assert builders.placement_text(pod_pl) == "a:0,1 + b:0,1"

    def pod(where: str) -> dict[str, Any]:
        return {"metadata": {"namespace": "default", "annotations": {builders.ANNOTATION_PLACEMENT: where},
                             "labels": {builders.LABEL_DEPLOYMENT: "llama", builders.LABEL_REPLICA: "0"}},
                "status": {"phase": "Running"}}

    led.restore(key, group)
    drains = draining.Drains()
    led.release(key)
    (d,) = draining.hold(led, drains, key, group)
    d.stopped = True
    assert d.where == "a:0,1 + b:0,1" and led.used_bytes("b", 1) == 30 * gib
    assert draining.ended(drains, "default", "llama", [pod("a:0,1"), pod("b:0,1")]) == []
    assert draining.ended(drains, "default", "llama", [pod("b:0,1")]) == []  # the worker still holds it
    group_obj = {"metadata": {"labels": {builders.LABEL_DEPLOYMENT: "llama", builders.LABEL_REPLICA: "0"},
                              "annotations": {builders.ANNOTATION_PLACEMENT: d.where}}}
    assert draining.ended(drains, "default", "llama", [], groups=[group_obj]) == []  # its LeaderWorkerSet is not gone
    assert draining.ended(drains, "default", "llama", []) == [d.name]
    # at start-up: both pods of a booked group are covered, no drain for either
    covered = {(key, 0): ("a:0,1 + b:0,1", "")}
    pods_ = [{**pod(w), "metadata": {**pod(w)["metadata"], "name": w}} for w in ("a:0,1", "b:0,1")]
    assert draining.from_pods(placement.Ledger(infos), pods_, covered) == {}


async def test_a_lost_worker_with_its_group_running_moves_it_once_the_old_pods_are_gone(
        cluster: Cluster, lws_operator: Operator) -> None:
    """Break-then-make across nodes: the old leader still holds its node's GPUs, which the group's
    new placement books again; the old LeaderWorkerSet is deleted, and the new one is written only
    when no pod of the old group is left."""
    for n in ("h100-a", "h100-b", "h100-c"):
        await cluster.create(node(n, gpus=8))
    await cluster.create(vd("llama", LLAMA_405B, **BIG))
    st = await cluster.phase("llama", "Admitted", "Running")
    (p,) = st["placement"]
    old = f"{p['node']}:0,1,2,3,4,5,6,7"
    pods = await group_pods(cluster, "llama-0")
    await cluster.delete_node(p["workers"][0]["node"])
    await cluster.until(lambda: cluster.get(LWS, "llama-0") is None, what="the old group stopped")
    (q,) = cluster.status("llama")["placement"]
    now = " + ".join(sorted(f"{n}:0,1,2,3,4,5,6,7" for n in (q["node"], q["workers"][0]["node"])))
    assert old in now  # the leader's node is booked again by the group's new placement
    await settle_drains(lws_operator.store)
    assert cluster.get(LWS, "llama-0") is None  # the old leader still runs there
    for pod in pods:
        await cluster.core.delete_namespaced_pod(pod, "default")
    await settle_drains(lws_operator.store)
    m = await cluster.until(lambda: cluster.get(LWS, "llama-0"), what="the group written at its new placement")
    assert m["metadata"]["annotations"][builders.ANNOTATION_PLACEMENT] == now


def test_a_reservation_swap_on_a_workers_node_moves_the_workers_gpu() -> None:
    """The device plugin gave a worker's reservation another GPU of its node: the worker's GPUs
    in the status change, the leader's (another node) do not."""
    from vllmfit.backends import reservation as rsv

    def refs(*ix: int) -> list[api.GpuRef]:
        return [api.GpuRef(index=i) for i in ix]

    p = api.ReplicaPlacement(replica=0, node="a", gpus=refs(0, 1), workers=[api.PodPlacement(node="b", gpus=refs(0, 1))])
    (q,) = rsv.swap_placement([p], "b", 1, 3, {3: "GPU-3"})
    assert [g.index for g in q.gpus] == [0, 1] and [(g.index, g.uuid) for g in q.workers[0].gpus] == [(0, None),
                                                                                                       (3, "GPU-3")]


def test_a_groups_placement_text_orders_its_pods_by_node_name_as_its_bookings_do() -> None:
    """"gpu-node-10:0" sorts before "gpu-node-1:0" as text (":" after "0"), but the bookings order
    their nodes by name: the text the LeaderWorkerSet and the status carry must be the bookings' own,
    or a restart reads the group as placed elsewhere and its drain ends while its pods run."""
    from vllmfit.core.memory import Footprint
    from vllmfit.core.placement import Booking
    from vllmfit.operator.booking import draining

    books = [Booking("default/llama", 0, n, 0, Footprint(1, 0, 0, 0, 0, 0)) for n in ("gpu-node-10", "gpu-node-1")]
    pl = api.ReplicaPlacement(replica=0, node="gpu-node-10", gpus=[api.GpuRef(index=0)],
                              workers=[api.PodPlacement(node="gpu-node-1", gpus=[api.GpuRef(index=0)])])
    assert draining.where_of(books) == "gpu-node-1:0 + gpu-node-10:0"
    assert builders.placement_text(pl) == draining.where_of(books)
