"""A replica across nodes rendered as one LeaderWorkerSet: the leader's `vllm serve` flags are the
ones `plan` computed, each pod is pinned to its own node and GPUs, the launch is Ray's as vLLM's
multi-node-serving.sh does it, and each pod template passes the Kubernetes Pod schema."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from vllmfit.core import placement
from vllmfit.core.spec import api
from vllmfit.operator.rendering import builders, lws
from vllmfit.sources import catalog

H100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
LLAMA_405B = catalog.model("meta-llama/Llama-3.1-405B-Instruct")
BIG = {"tensorParallelSize": 8, "pipelineParallelSize": 2, "maxModelLen": 32768, "kvCache": {"tokens": 131072}}


def _planned() -> tuple[api.VLLMDeployment, placement.Decision]:
    nodes = [placement.NodeInfo(n, {}, tuple(placement.GpuSlot(n, i, H100) for i in range(8))) for n in ("h100-a", "h100-b")]
    spec = api.VLLMDeploymentSpec.model_validate({"model": LLAMA_405B.name, **BIG})
    d = placement.plan(nodes, [placement.Request("big/llama", spec, LLAMA_405B, ("", "big/llama"))]).decisions["big/llama"]
    assert d.admitted
    obj = api.VLLMDeployment.model_validate({"metadata": {"name": "llama", "namespace": "big"},
                                             "spec": {"model": LLAMA_405B.name, **BIG}})
    return obj, d


def _pods(d: placement.Decision) -> list[api.ReplicaPlacement]:
    r = d.replicas[0]
    return [api.ReplicaPlacement(replica=r.replica, node=m.node, gpus=[api.GpuRef(index=i) for i in m.gpus])
            for m in r.members]


def _as_pod(tpl: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **tpl["metadata"]}, "spec": tpl["spec"]}


def test_one_leader_worker_set_per_replica_with_the_flags_plan_computed() -> None:
    obj, d = _planned()
    assert d.flags is not None
    pods = _pods(d)
    m = lws.leader_worker_set(obj, pods, d.flags, obj.spec.model, exclusive=[True, True])
    assert (m["apiVersion"], m["kind"], m["metadata"]["name"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet",
                                                                  "llama-0")
    t = m["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = t["leaderTemplate"], t["workerTemplate"]
    lc, wc = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    # the leader runs the Ray head, then vllm serve with the computed flags as argv (never shell text)
    assert lc["command"][:2] == ["sh", "-c"] and "ray start --head --port=6379" in lc["command"][2]
    assert lc["command"][2].endswith('exec vllm serve "$@"') and lc["command"][3] == "vllm"
    assert lc["args"][0] == LLAMA_405B.name
    for flag in [*d.flags.args(), "--tensor-parallel-size=8", "--pipeline-parallel-size=2",
                 "--distributed-executor-backend=ray"]:
        assert flag in lc["args"], flag
    # the worker joins the head at the leader's address and blocks
    assert wc["command"] == ["sh", "-c", 'until ray start --address="$LWS_LEADER_ADDRESS:6379" --block; do sleep 5; done']
    assert "startupProbe" not in wc and "readinessProbe" not in wc
    # each pod on its own node, with its own node's 8 GPUs
    lead_node, work_node = pods[0].node, pods[1].node
    assert leader["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchFields"][0]["values"] == [lead_node]
    assert worker["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchFields"][0]["values"] == [work_node]
    assert lc["resources"]["limits"]["nvidia.com/gpu"] == wc["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert m["metadata"]["annotations"][builders.ANNOTATION_PLACEMENT] == \
        f"{lead_node}:0,1,2,3,4,5,6,7 + {work_node}:0,1,2,3,4,5,6,7"
    for tpl in (leader, worker):
        kubernetes_validate.validate(_as_pod(tpl), kubernetes_validate.latest_version(), strict=True)


def test_a_shared_pod_is_pinned_to_its_gpus_behind_the_start_gate() -> None:
    obj, d = _planned()
    assert d.flags is not None
    m = lws.leader_worker_set(obj, _pods(d), d.flags, obj.spec.model, exclusive=[False, False], gated=[True, True])
    for role in ("leaderTemplate", "workerTemplate"):
        spec = m["spec"]["leaderWorkerTemplate"][role]["spec"]
        assert spec["schedulingGates"] and "nvidia.com/gpu" not in (spec["containers"][0]["resources"].get("limits") or {})


def test_workers_with_different_gpu_indices_cannot_share_one_template() -> None:
    pods = [api.ReplicaPlacement(replica=0, node=n, gpus=[api.GpuRef(index=i) for i in g])
            for n, g in (("a", [0, 1]), ("b", [0, 1]), ("c", [2, 3]))]
    assert "share one pod template" in (lws.template_problem(pods) or "")
    obj, d = _planned()
    assert d.flags is not None
    with pytest.raises(ValueError, match="same GPU indices"):
        lws.leader_worker_set(obj, pods, d.flags, "m", exclusive=[False] * 3)


def test_a_groups_pods_load_the_sized_commit_and_verify_a_tenants_cache() -> None:
    """What binds a one-node replica's weights binds a group's: the leader runs `vllm serve` with
    --revision at the commit that was sized, and every pod verifies a cache the tenant can write."""
    from vllmfit.operator.rendering import verifier

    obj, d = _planned()
    commit = "a" * 40
    check = verifier.Check(LLAMA_405B.name, "digest", LLAMA_405B.params, "vllmfit:test", commit)
    binding = [{"revision": commit, "verify": check}] * 2
    m = lws.leader_worker_set(obj, _pods(d), d.flags, obj.spec.model, exclusive=[True, True], binding=binding)
    t = m["spec"]["leaderWorkerTemplate"]
    assert f"--revision={commit}" in t["leaderTemplate"]["spec"]["containers"][0]["args"]
    for tpl in (t["leaderTemplate"], t["workerTemplate"]):
        assert [c["name"] for c in tpl["spec"].get("initContainers") or []][-1:] == [verifier.NAME]
