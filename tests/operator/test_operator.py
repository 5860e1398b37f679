"""The real operator (Kopf + vllmfit.operator.handlers) against KMock's Kubernetes emulator."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import kmock
import pytest
from opkit import DEPLOYMENTS, H100, SERVICES, VD, Cluster, Operator, node, used_from_statuses, vd

from vllmfit.core import defaults
from vllmfit.core.spec import api
from vllmfit.operator.booking import report
from vllmfit.operator.handlers import common, decide, startup
from vllmfit.operator.rendering import builders
from vllmfit.sources import catalog

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

GIB = 1 << 30
QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
BUDGET = math.ceil(0.90 * catalog.gpu(H100).cuda_total_bytes) + defaults.CUDA_CONTEXT_BYTES  # counted, by hand


def total(status: dict[str, Any]) -> int:
    """Bytes booked per GPU by one deployment (every GPU of a replica books the same)."""
    return status["memory"][0]["totalBytes"]


def args_of(cluster: Cluster, name: str) -> list[str]:
    d = cluster.get(DEPLOYMENTS, name)
    assert d is not None, f"no Deployment {name}"
    return d["spec"]["template"]["spec"]["containers"][0]["args"]


def env_of(cluster: Cluster, name: str) -> dict[str, Any]:
    d = cluster.get(DEPLOYMENTS, name)
    return {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def node_of(cluster: Cluster, name: str) -> str:
    d = cluster.get(DEPLOYMENTS, name)
    terms = d["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return terms[0]["matchFields"][0]["values"][0]


async def test_create_admits_and_writes_deployment_service_and_status(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2))
    obj = vd("llama", QWEN7, hfTokenSecretRef={"name": "hf"}, extraArgs=["--served-model-name", "llama"])
    await cluster.create(obj)
    st = await cluster.phase("llama", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "llama-0") and cluster.get(SERVICES, "llama"))

    assert (st["node"], st["gpuList"], st["observedGeneration"], st["vllmVersion"]) == ("gpu-a", "0", 1, "0.33")
    [m] = st["memory"]
    assert m["totalBytes"] == m["weightsBytes"] + m["kvCacheBytes"] + m["activationBytes"] + m["overheadBytes"]
    [g] = st["gpus"]
    assert (g["budgetBytes"], g["usedBytes"], g["headroomBytes"]) == (BUDGET, m["totalBytes"], BUDGET - m["totalBytes"])
    assert st["headroom"] == f"{(BUDGET - m['totalBytes']) / GIB:.1f} GiB"
    assert [c["type"] for c in st["conditions"]][:3] == ["Admitted", "Placed", "Ready"]
    assert condition(st, "Admitted")["status"] == "True"
    assert condition(st, "Ready")["status"] == "False"

    f = st["flags"]
    args = args_of(cluster, "llama-0")
    assert args[:3] == [QWEN7, "--host=0.0.0.0", "--port=8000"]
    assert f"--max-model-len={f['maxModelLen']}" in args
    assert f"--max-num-seqs={f['maxNumSeqs']}" in args
    assert f"--gpu-memory-utilization={f['gpuMemoryUtilization']:.4f}" in args
    assert "--tensor-parallel-size=1" in args and args[-2:] == ["--served-model-name", "llama"]
    dep = cluster.get(DEPLOYMENTS, "llama-0")
    for child in (dep, cluster.get(SERVICES, "llama")):
        [ref] = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (api.KIND, "llama",
                                                                               obj["metadata"]["uid"], True)
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "vllmfit"
        assert child["metadata"]["labels"]["vllmfit.dev/deployment"] == "llama"
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in container["env"]
    # a node whose agent reports no enforcement: the replica runs counted, not enforced, and the
    # admission's Event says so, as a Warning (one Event a decision)
    admitted = await cluster.event("llama", "Admitted")
    assert admitted["type"] == "Warning" and "replica 0 on gpu-a: the node reports no per-container GPU memory" \
        in admitted["message"] and admitted["message"].endswith("its booking is counted, not enforced")
    assert [e["reason"] for e in cluster.events("llama")] == ["Admitted"]
    assert condition(cluster.status("llama"), "Enforced")["status"] == "False"


async def test_update_recomputes_flags_and_patches_the_same_deployment(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("llama", QWEN7))
    before = await cluster.phase("llama", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "llama-0"))
    await cluster.patch_spec("llama", {"maxModelLen": 8192, "extraArgs": ["--enable-prefix-caching"]})
    await cluster.until(lambda: cluster.status("llama").get("observedGeneration") == 2)
    await cluster.until(lambda: "--max-model-len=8192" in args_of(cluster, "llama-0"))
    await cluster.store.writer.flush()
    st = cluster.status("llama")
    assert st["flags"]["maxModelLen"] == 8192
    assert total(st) < total(before)  # a shorter context books less KV cache
    # the difference stays booked (a drain) until the API lists no pod written for the old
    # booking: here none ever ran, so it ends at the first look
    await cluster.until(lambda: cluster.status("llama")["gpus"][0]["headroomBytes"] == BUDGET - total(st),
                        what="the resize's drain ended")
    assert args_of(cluster, "llama-0")[-1] == "--enable-prefix-caching"
    assert [d["metadata"]["name"] for d in cluster.objects(DEPLOYMENTS)] == ["llama-0"]


async def test_delete_frees_room_and_the_neighbours_headroom_grows(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7))
    await cluster.phase("a", "Admitted")
    await cluster.create(vd("b", QWEN7))
    b = await cluster.phase("b", "Admitted")
    a = cluster.status("a")
    both = total(a) + total(b)
    assert a["gpus"][0]["headroomBytes"] == b["gpus"][0]["headroomBytes"] == BUDGET - both
    await cluster.delete("a")
    await cluster.until(lambda: cluster.get(VD, "a") is None, what="a to be gone")
    await cluster.until(lambda: cluster.status("b")["gpus"][0]["headroomBytes"] == BUDGET - total(b))
    assert cluster.store.books.ledger.deployments() == ["default/b"]


async def test_colocated_deployments_share_the_gpu_through_visible_devices(cluster: Cluster,
                                                                            operator: Operator) -> None:
    uuids = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]
    inventory = {"sampled_at": "2030-01-01T00:00:00Z", "nvml": True, "gpus": [
        {"index": i, "uuid": u, "product": H100, "total_bytes": 81559 * defaults.MIB, "used_bytes": 0}
        for i, u in enumerate(uuids)]}
    await cluster.create(node("gpu-a", gpus=2, annotations={defaults.INVENTORY_ANNOTATION: json.dumps(inventory)}))
    pin = {"nodeName": "gpu-a", "gpuIndices": [1]}
    await cluster.create(vd("a", QWEN7, placement=pin))
    await cluster.create(vd("b", QWEN7, maxModelLen=8192, placement=pin))
    await cluster.phase("a", "Admitted")
    await cluster.phase("b", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and cluster.get(DEPLOYMENTS, "b-0"))
    for name in ("a-0", "b-0"):
        pod = cluster.get(DEPLOYMENTS, name)["spec"]["template"]["spec"]
        assert env_of(cluster, name)["NVIDIA_VISIBLE_DEVICES"] == uuids[1]
        assert pod["runtimeClassName"] == "nvidia"
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
    used = total(cluster.status("a")) + total(cluster.status("b"))
    for name in "ab":
        assert cluster.status(name)["gpus"] == [{"node": "gpu-a", "index": 1, "budgetBytes": BUDGET,
                                                 "usedBytes": used, "headroomBytes": BUDGET - used}]
        assert cluster.status(name)["placement"][0]["gpus"][0]["uuid"] == uuids[1]


async def test_a_newcomer_shares_without_limits_and_the_first_keeps_its_device_plugin_gpu(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("first", QWEN7))
    await cluster.phase("first", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "first-0"))
    await cluster.create(vd("second", QWEN7, maxModelLen=8192))
    await cluster.phase("second", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "second-0"))
    await cluster.store.writer.flush()
    first = cluster.get(DEPLOYMENTS, "first-0")["spec"]["template"]["spec"]
    assert first["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1  # unchanged: not restarted
    assert env_of(cluster, "second-0")["NVIDIA_VISIBLE_DEVICES"] == "0"
    assert cluster.status("first")["gpus"][0]["headroomBytes"] == BUDGET - total(cluster.status("first")) - total(
        cluster.status("second"))


async def test_a_deployment_alone_on_all_gpus_of_a_node_uses_device_plugin_limits(cluster: Cluster,
                                                                                  operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(vd("big", QWEN7, tensorParallelSize=2))
    st = await cluster.phase("big", "Admitted")
    assert st["gpuList"] == "0,1"
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "big-0"))
    pod = cluster.get(DEPLOYMENTS, "big-0")["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "runtimeClassName" not in pod and "NVIDIA_VISIBLE_DEVICES" not in env_of(cluster, "big-0")


async def test_two_deployments_in_the_same_instant_never_both_take_the_last_room(cluster: Cluster,
                                                                                  operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    # each books more than half of the GPU's budget
    await asyncio.gather(*(cluster.create(vd(n, QWEN7, gpuMemoryUtilization=0.5)) for n in ("x", "y")))
    await cluster.until(lambda: {cluster.status(n).get("phase") for n in "xy"} == {"Admitted", "Unschedulable"})
    await cluster.store.writer.flush()
    statuses = [cluster.status(n) for n in "xy"]
    assert sum(s["phase"] == "Admitted" for s in statuses) == 1
    assert all(v <= BUDGET for v in used_from_statuses(statuses).values())
    loser = next(s for s in statuses if s["phase"] == "Unschedulable")
    assert "GPU 0" in loser["reasons"][0]


async def test_rejections_have_a_condition_and_an_event_and_are_reexamined_on_spec_change(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("unknown", "no-such-model"))
    await cluster.create(vd("badarg", QWEN7, extraArgs=["--max-model-len=4096"]))
    await cluster.create(vd("badtp", QWEN7, tensorParallelSize=0))
    for name, reason, text in [("unknown", "ModelNotFound", "unknown model 'no-such-model'"),
                               ("badarg", "InvalidSpec", "use spec.maxModelLen instead"),
                               ("badtp", "InvalidSpec", "spec.tensorParallelSize")]:
        st = await cluster.phase(name, "Rejected")
        c = condition(st, "Admitted")
        assert (c["status"], c["reason"]) == ("False", reason) and text in c["message"]
        await cluster.until(lambda n=name: cluster.events(n), what=f"an event for {name}")
        [ev] = cluster.events(name)
        assert (ev["type"], ev["reason"]) == ("Warning", reason) and text in ev["message"]
    assert cluster.objects(DEPLOYMENTS) == []
    await cluster.patch_spec("badarg", {"extraArgs": ["--enable-prefix-caching"]})
    st = await cluster.phase("badarg", "Admitted")
    assert st["observedGeneration"] == 2
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "badarg-0"))


async def test_unschedulable_explains_and_is_admitted_when_room_frees_up(cluster: Cluster,
                                                                         operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    eight = {"kvCache": {"concurrency": 8}}  # 8 full-context (32k) requests of KV each: two fit a GPU
    await cluster.create(vd("a", QWEN7, **eight))
    await cluster.phase("a", "Admitted")
    await cluster.create(vd("b", QWEN7, **eight))
    await cluster.phase("b", "Admitted")
    await cluster.create(vd("c", QWEN7, **eight))
    st = await cluster.phase("c", "Unschedulable")
    assert st["reasons"] and "gpu-a" in st["reasons"][0]
    assert condition(st, "Admitted")["reason"] == "Unschedulable"
    await cluster.until(lambda: cluster.events("c"))
    assert cluster.events("c")[0]["reason"] == "Unschedulable"
    # grouped like the kube-scheduler, the same words in the condition, the Event and status.reasons
    grouped = f"0/1 nodes are available: {st['reasons'][0]}"
    assert st["reasons"][0].startswith("1 GPU memory (needs ") and st["reasons"][0].endswith(" on gpu-a GPU 0)")
    assert condition(st, "Admitted")["message"].startswith(grouped)
    assert cluster.events("c")[0]["message"].startswith(grouped)
    assert cluster.get(DEPLOYMENTS, "c-0") is None
    await cluster.delete("a")
    st = await cluster.phase("c", "Admitted")
    assert "room freed up" not in st["conditions"][0]["message"]  # admitted, not moved
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "c-0"))


async def test_a_spec_created_before_its_node_waits_and_is_admitted_when_the_node_appears(
        cluster: Cluster, operator: Operator) -> None:
    """Nodes and VLLMDeployments reach the operator on two watch streams in no set order: a spec
    seen before any GPU node is Unschedulable, and the node's arrival gives it another chance."""
    await cluster.create(vd("early", QWEN7))
    st = await cluster.phase("early", "Unschedulable")
    assert condition(st, "Admitted")["reason"] == "Unschedulable"
    await cluster.create(node("gpu-a", gpus=1))
    st = await cluster.phase("early", "Admitted")
    assert st["node"] == "gpu-a"
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "early-0"))
    await cluster.event("early", "Unschedulable")
    await cluster.event("early", "Admitted")


async def test_a_waiting_spec_retried_in_vain_says_why_it_waits_now(cluster: Cluster, operator: Operator) -> None:
    """Two specs seen before any GPU node (0/0 nodes): the node has room for one; the other is
    retried, still does not fit, and its status names the GPU that is full now, not the old
    reason."""
    await asyncio.gather(*(cluster.create(vd(n, QWEN7, gpuMemoryUtilization=0.5)) for n in ("x", "y")))
    for n in "xy":
        st = await cluster.phase(n, "Unschedulable")
        assert st["reasons"][0].startswith("0/0 nodes") or "no GPU" in st["reasons"][0], st["reasons"]
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.until(lambda: {cluster.status(n).get("phase") for n in "xy"} == {"Admitted", "Unschedulable"})
    loser = next(n for n in "xy" if cluster.status(n)["phase"] == "Unschedulable")
    await cluster.until(lambda: "GPU 0" in cluster.status(loser)["reasons"][0],
                        what=f"{loser}'s reason to name GPU 0, is {cluster.status(loser)['reasons']}")
    await cluster.store.writer.flush()
    st = cluster.status(loser)
    assert "gpu-a" in condition(st, "Admitted")["message"]


async def test_node_deleted_moves_its_deployment(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(node("gpu-b", gpus=1))
    await cluster.create(vd("a", QWEN7))
    st = await cluster.phase("a", "Admitted")
    first = st["node"]
    other = "gpu-b" if first == "gpu-a" else "gpu-a"
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    await cluster.delete_node(first)
    await cluster.until(lambda: cluster.status("a").get("node") == other)
    # a move stops the old replica first (its Deployment is deleted, then written where it goes)
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and node_of(cluster, "a-0") == other)
    st = cluster.status("a")
    assert condition(st, "Placed")["reason"] == "Moved"
    await cluster.until(lambda: [e for e in cluster.events("a") if e["reason"] == "Moved"])
    [moved] = [e for e in cluster.events("a") if e["reason"] == "Moved"]
    assert f"{first}:0" in moved["message"] and f"{other}:0" in moved["message"] and "removed" in moved["message"]


async def test_foreign_use_growing_evicts_the_newest_then_a_new_node_takes_it(cluster: Cluster,
                                                                              operator: Operator) -> None:
    def inventory(used: int) -> dict[str, str]:
        inv = {"sampled_at": "2030-01-01T00:00:00Z", "nvml": True, "gpus": [
            {"index": 0, "uuid": "GPU-a0", "product": H100, "total_bytes": 81559 * defaults.MIB,
             "used_bytes": used}]}
        return {defaults.INVENTORY_ANNOTATION: json.dumps(inv)}

    await cluster.create(node("gpu-a", gpus=1, annotations=inventory(0)))
    await cluster.create(vd("old", QWEN7))
    await cluster.phase("old", "Admitted")
    await cluster.create(vd("new", QWEN7, maxModelLen=32768, kvCache={"concurrency": 8}))  # fixed: cannot shrink to stay
    await cluster.phase("new", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "new-0"))
    await cluster.patch_node("gpu-a", {"metadata": {"annotations": inventory(20 * GIB)}})  # something else grew
    st = await cluster.phase("new", "Unschedulable")
    assert "node gpu-a changed" in condition(st, "Admitted")["message"]
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "new-0") is None, what="new-0 deleted")
    # new's memory stays booked (a drain) until the API shows its pods are gone, then old's GPU shows
    # only old and the foreign use
    await cluster.until(lambda: cluster.status("old")["gpus"][0]["usedBytes"] == total(cluster.status("old")) + 20 * GIB,
                        what="the evicted replica's memory released once its pods are gone")
    old = cluster.status("old")
    assert old["phase"] == "Admitted"
    await cluster.create(node("gpu-b", gpus=1))
    st = await cluster.phase("new", "Admitted")
    assert st["node"] == "gpu-b"
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "new-0") and node_of(cluster, "new-0") == "gpu-b")


async def test_restart_rebuilds_the_same_ledger_and_doubles_nothing(km: Any, cluster: Cluster) -> None:
    op = Operator(km)
    await op.start()
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(node("gpu-b", gpus=2))
    names = ["a", "b", "c", "d"]
    for n, extra in zip(names, [{}, {"tensorParallelSize": 2}, {"maxModelLen": 8192}, {"replicas": 2}]):
        await cluster.create(vd(n, QWEN7, **extra))
    for n in names:
        await cluster.phase(n, "Admitted")
    await cluster.until(lambda: len(cluster.objects(DEPLOYMENTS)) == 5)
    def bookings(ledger: Any) -> dict[str, list[tuple[Any, ...]]]:
        return {k: [(b.replica, b.node, b.index, b.footprint.weights, b.footprint.kv_cache, b.footprint.activation,
                     b.footprint.total) for b in ledger.bookings_of(k)] for k in ledger.deployments()}

    before = bookings(cluster.store.books.ledger)
    statuses = {n: cluster.status(n) for n in names}
    templates = {d["metadata"]["name"]: d["spec"]["template"] for d in cluster.objects(DEPLOYMENTS)}
    assert all(t["metadata"]["annotations"][builders.ANNOTATION_BOOKED] for t in templates.values())
    await op.stop()
    await cluster.reconnect()
    await cluster.create(vd("e", QWEN7, maxModelLen=4096))  # created while the operator is down
    await op.start()
    try:
        await cluster.phase("e", "Admitted")
        await cluster.store.writer.flush()
        new = cluster.store.books.ledger
        after = bookings(new)
        assert {k: v for k, v in after.items() if k != "default/e"} == before
        for n in names:
            assert cluster.status(n)["placement"] == statuses[n]["placement"]
            assert cluster.status(n)["memory"] == statuses[n]["memory"]
        used = used_from_statuses([cluster.status(n) for n in [*names, "e"]])
        assert all(v <= BUDGET for v in used.values())
        for (n, i), v in used.items():
            assert new.used_bytes(n, i) == v
        await cluster.until(lambda: len(cluster.objects(DEPLOYMENTS)) == 6)
        deployments = sorted(d["metadata"]["name"] for d in cluster.objects(DEPLOYMENTS))
        assert deployments == ["a-0", "b-0", "c-0", "d-0", "d-1", "e-0"]
        # a pod template written again differently would restart its vLLM (Recreate): the restored
        # bookings give the same template, vllmfit.dev/booked included
        assert {n: cluster.get(DEPLOYMENTS, n)["spec"]["template"] for n in templates} == templates
    finally:
        await op.stop()


async def test_hundred_deployments_at_once_never_overbook_a_gpu(km: Any, cluster: Cluster,
                                                                operator: Operator) -> None:
    for i in range(4):
        await cluster.create(node(f"gpu-{i}", gpus=2))
    models = [("Qwen/Qwen2.5-0.5B-Instruct", {}), (QWEN7, {}), (QWEN7, {"maxModelLen": 8192}),
              ("Qwen/Qwen2.5-1.5B-Instruct", {"replicas": 2}), (QWEN7, {"tensorParallelSize": 2})]
    objs = [vd(f"d{i:03d}", models[i % len(models)][0], **models[i % len(models)][1]) for i in range(100)]
    await asyncio.gather(*(cluster.create(o) for o in objs))
    final = {"Admitted", "Unschedulable", "Rejected"}
    await cluster.until(lambda: len(ph := cluster.phases()) == 100 and set(ph.values()) <= final,
                        timeout=30, what="every deployment to reach a final phase")
    await cluster.store.writer.flush()

    # Replay every status write in the order the API server received them: after each one, the
    # bytes booked per GPU (from the stored statuses alone) stay within the GPU's budget.
    current: dict[str, dict[str, Any]] = {}
    writes = 0
    for req in km.sent("patch", VD):
        if isinstance(req.data, dict) and "status" in req.data and req.name:
            current[req.name] = req.data["status"]
            writes += 1
            used = used_from_statuses(list(current.values()))
            assert all(v <= BUDGET for v in used.values()), f"over budget after write {writes}: {used}"
    phases = [cluster.status(o["metadata"]["name"])["phase"] for o in objs]
    admitted = phases.count("Admitted")
    assert admitted > 10 and phases.count("Unschedulable") > 0
    ledger = cluster.store.books.ledger
    for (n, i), v in used_from_statuses([cluster.status(o["metadata"]["name"]) for o in objs]).items():
        assert ledger.used_bytes(n, i) == v <= BUDGET
    replicas = sum(len(cluster.status(o["metadata"]["name"])["placement"]) for o in objs)
    await cluster.until(lambda: len(cluster.objects(DEPLOYMENTS)) == replicas)


async def test_pods_drive_ready_running_and_failed(km: Any, cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("llama", QWEN7))
    await cluster.phase("llama", "Admitted")
    labels = {"vllmfit.dev/deployment": "llama", "vllmfit.dev/replica": "0",
              "app.kubernetes.io/managed-by": "vllmfit"}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "llama-0-abc", "namespace": "default", "uid": "pod-uid-1", "labels": labels},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "imageID": "", "ready": True, "restartCount": 0,
                "state": {"running": {}}}]}}
    await cluster.create(pod)
    st = await cluster.phase("llama", "Running")
    assert condition(st, "Ready")["status"] == "True" and st["podUids"] == ["pod-uid-1"]

    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has 0.5 GiB free."
    km["get", kmock.resource("v1/pods"), kmock.subresource("log"), kmock.name("llama-0-abc")] << \
        f"INFO loading weights\n{oom}\nINFO shutting down\n".encode()
    await cluster.patch_pod("llama-0-abc", {"status": {"containerStatuses": [
        {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "imageID": "", "ready": False, "restartCount": 1,
         "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
         "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}})
    st = await cluster.phase("llama", "Failed")
    ready = condition(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "CudaOutOfMemory") and oom in ready["message"]
    await cluster.until(lambda: [e for e in cluster.events("llama") if e["reason"] == "CudaOutOfMemory"])


async def test_models_from_a_config_map_and_inline(cluster: Cluster, operator: Operator) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 16,
              "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
              "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.core.create_namespaced_config_map("default", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tiny"},
        "data": {"config.json": json.dumps(config)}})
    await cluster.create(vd("inline", "acme/tiny", modelConfig=config, modelParams=1_235_814_400))
    await cluster.create(vd("ref", "acme/tiny", modelConfigRef={"name": "tiny"}))
    await cluster.create(vd("missing", "acme/tiny", modelConfigRef={"name": "nope"}))
    a = await cluster.phase("inline", "Admitted")
    b = await cluster.phase("ref", "Admitted")
    assert a["flags"]["maxModelLen"] == b["flags"]["maxModelLen"] == 8192
    st = await cluster.phase("missing", "Pending")
    c = condition(st, "Admitted")
    assert (c["status"], c["reason"]) == ("Unknown", "ModelUnavailable") and "default/nope" in c["message"]
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "ref-0"))
    assert args_of(cluster, "ref-0")[0] == "acme/tiny"


async def test_scaling_down_deletes_the_extra_replica(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(vd("r", QWEN7, replicas=2))
    st = await cluster.phase("r", "Admitted")
    assert len(st["placement"]) == 2 and len(st["memory"]) == 2
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "r-0") and cluster.get(DEPLOYMENTS, "r-1"))
    await cluster.patch_spec("r", {"replicas": 1})
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "r-1") is None, what="r-1 deleted")
    await cluster.store.writer.flush()
    st = cluster.status("r")
    assert len(st["placement"]) == 1 and len(st["memory"]) == 1 and cluster.get(DEPLOYMENTS, "r-0")


async def test_resync_on_a_quiet_active_operator_changes_nothing(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2))
    for name in ("a", "b"):
        await cluster.create(vd(name, QWEN7, maxModelLen=8192))
    for name in ("a", "b"):
        await cluster.phase(name, "Admitted")
    store = cluster.store
    await store.writer.flush()
    records = dict(store.cache.records)

    def bookings() -> dict[str, list[tuple[Any, ...]]]:
        return {k: [(b.replica, b.node, b.index, b.footprint.weights, b.footprint.kv_cache, b.footprint.total)
                    for b in store.books.ledger.bookings_of(k)] for k in store.books.ledger.deployments()}

    before = bookings()
    for _ in range(100):  # it skips while a status write or a change is in flight (KMock echoes some)
        if await startup.resync_once(store):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("resync never ran on a quiet operator")
    assert bookings() == before
    assert all(store.cache.records[k] is records[k] for k in records)


async def test_a_status_written_by_the_previous_active_replica_is_booked_not_doubled(
        cluster: Cluster, operator: Operator) -> None:
    """Fail-over: the object was admitted by a peer (its handling annotation and its status are
    there); this operator never saw it being created, and must still count its GPU memory."""
    from vllmfit.core import placement as pl
    from vllmfit.operator.booking.state import Store

    await cluster.create(node("gpu-a", gpus=1))
    peer = Store()  # what the other replica decided
    peer.rebuild([node("gpu-a", gpus=1)], [])
    obj = vd("old", QWEN7, maxModelLen=32768, kvCache={"concurrency": 8})
    rec = peer.cache.upsert(obj)
    req = await peer.request_for(common.parse(obj))
    with peer.books.step():
        decide.apply_decision(peer, rec, req, pl.decide(peer.books.ledger, req), common.Effects())
    obj["status"] = report.status(rec, peer.books.ledger)
    obj["metadata"]["annotations"] = {"vllmfit.dev/last-handled-configuration": json.dumps(
        {"spec": obj["spec"], "metadata": {}})}
    obj["metadata"]["finalizers"] = ["vllmfit.dev/finalizer"]
    from bookkit import child
    from kubernetes_asyncio import client

    written = {"apiVersion": "apps/v1", "kind": "Deployment", "spec": {}, **child(obj, "gpu-a:0")}
    written["metadata"]["ownerReferences"][0]["apiVersion"] = obj["apiVersion"]
    labels = written["metadata"]["labels"]
    written["spec"] = {"selector": {"matchLabels": labels}, "template": {
        "metadata": {"labels": labels}, "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}}
    await client.AppsV1Api(cluster.api).create_namespaced_deployment("default", written)  # the peer wrote it too
    await cluster.create(obj)
    await cluster.until(lambda: cluster.store.books.ledger.bookings_of("default/old"), what="the peer's bookings")
    await cluster.create(vd("new", QWEN7, maxModelLen=32768, kvCache={"concurrency": 16}))  # fits only on an empty GPU
    st = await cluster.phase("new", "Unschedulable")
    assert "GPU 0" in st["reasons"][0]
    assert not cluster.store.cache.records["default/old"].mine  # adopted as the peer wrote it, not decided again
    assert cluster.status("old") == obj["status"]
    used = used_from_statuses([cluster.status("old"), cluster.status("new")])
    assert used == {("gpu-a", 0): total(cluster.status("old"))} and cluster.store.books.ledger.used_bytes("gpu-a", 0) == \
        total(cluster.status("old"))


async def test_unknown_layer_type_is_a_condition_and_strict_refuses(cluster: Cluster, operator: Operator) -> None:
    """Issue 13: a layer type the memory model does not know is never silent: ModelUnderstood=False
    names it on an admitted deployment; with spec.strict the deployment is rejected."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 16,
              "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
              "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
              "layer_types": ["full_attention"] * 15 + ["hyena_filter"]}
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("odd", "acme/odd", modelConfig=config, modelParams=1_235_814_400))
    await cluster.create(vd("strict", "acme/odd", modelConfig=config, modelParams=1_235_814_400, strict=True))
    st = await cluster.phase("odd", "Admitted")
    c = condition(st, "ModelUnderstood")
    assert (c["status"], c["reason"]) == ("False", "UnknownLayerType") and "'hyena_filter'" in c["message"]
    assert any("hyena_filter" in w for w in st["warnings"])
    refused = await cluster.phase("strict", "Rejected")
    assert "hyena_filter" in condition(refused, "Admitted")["message"]


async def test_the_kv_request_is_granted_injected_and_shown_in_status(cluster: Cluster, operator: Operator) -> None:
    """kvCache: 64 requests of 2k tokens with 8k per request: Qwen2.5-7B (28 layers x 4 KV heads x 128 x
    2 x 2 B = 57,344 B per token) books (64 x 128 + 1) blocks of 16 tokens; the pod gets them as
    --kv-cache-memory-bytes, and status.kvCache shows the tokens and the concurrency they buy."""
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("kv", QWEN7, maxModelLen=8192, kvCache={"concurrency": 64, "typicalLength": 2048}))
    st = await cluster.phase("kv", "Admitted")
    kv_bytes = (64 * 2048 // 16 + 1) * 16 * 57_344
    assert st["kvCache"] == {"bytes": kv_bytes, "tokens": 64 * 2048, "concurrencyAtMaxModelLen": 16.0,
                             "typicalLength": 2048, "concurrencyAtTypicalLength": 64.0,
                             "grantedBy": "kvCache.concurrency 64 x 2048 tokens",
                             # an explicit kvCache is its own request; the limit, vLLM's maxNumSeqs 1024 x 8192
                             "requestTokens": 64 * 2048, "requestBytes": kv_bytes, "limitTokens": 1024 * 8192}
    assert st["flags"]["kvCacheMemoryBytes"] == kv_bytes
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "kv-0"))
    args = args_of(cluster, "kv-0")
    assert f"--kv-cache-memory-bytes={kv_bytes}" in args
    assert "--max-num-seqs=1024" in args  # vLLM's own default on an H100 (maxNumSeqs unset)
