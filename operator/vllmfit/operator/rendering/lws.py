"""A replica across nodes as one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), the workload vLLM
documents for multi-node serving (docs.vllm.ai, "Deployment / Frameworks / LWS").

The group is `size` pods, one per node: the leader (pod 0) on the replica's first node, a worker on
each other node, each bound to its own GPUs as a one-node replica's pod is (`builders.deployment`:
device-plugin limits, or NVIDIA_VISIBLE_DEVICES with the reservation gate, or a DRA claim), with the
spec's podTemplate merged in. vLLM's launch is Ray's, as vLLM's `multi-node-serving.sh` does it: the
leader starts the Ray head, waits until the group's pods have joined, then runs `vllm serve` with
`--distributed-executor-backend=ray` and the computed flags; each worker joins the head at
`$(LWS_LEADER_ADDRESS)` and blocks. The vLLM arguments travel as argv (`sh -c SCRIPT vllm ARGS...`),
never through the shell's parser. `RecreateGroupOnPodRestart`: a lost pod restarts the whole group
(vLLM cannot re-admit one rank). One template serves every worker, so the workers of one group must
use the same GPU indices on their nodes (`template_problem`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from vllmfit.backends.binding import GPU_RESOURCE
from vllmfit.core.spec import api
from vllmfit.operator.rendering import builders

GROUP, VERSION, PLURAL, KIND = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet"
RAY_PORT = 6379
HOSTNAME = "kubernetes.io/hostname"
GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-key"  # LWS labels every pod of one group with it

# The leader: the Ray head, then vLLM once every pod of the group has joined (vLLM's
# multi-node-serving.sh `leader`: it counts the alive Ray nodes the same way).
LEADER_SCRIPT = (
    f'ray start --head --port={RAY_PORT} && '
    'until [ "$(python3 -c \'import ray; ray.init(address="auto"); print(sum(n["Alive"] for n in ray.nodes()))\' '
    '2>/dev/null | tail -n 1)" = "$LWS_GROUP_SIZE" ]; do sleep 5; done && exec vllm serve "$@"'
)
# A worker: join the head (retrying until it is up), then block (multi-node-serving.sh `worker`).
WORKER_SCRIPT = f'until ray start --address="$LWS_LEADER_ADDRESS:{RAY_PORT}" --block; do sleep 5; done'


def name(obj: api.VLLMDeployment, replica: int) -> str:
    return builders.deployment_name(obj.metadata.name, replica)


def template_problem(pods: Sequence[api.ReplicaPlacement]) -> str | None:
    """Why one LeaderWorkerSet cannot hold these pods (None: it can): its workers share one template."""
    if len(pods) < 2:
        return "a LeaderWorkerSet holds a replica across at least two nodes"
    if len({tuple(g.index for g in p.gpus) for p in pods[1:]}) > 1:
        return ("the workers of one LeaderWorkerSet share one pod template, so they must use the same GPU indices "
                f"on their nodes ({'; '.join(builders.placement_text(p) for p in pods[1:])})")
    return None


def leader_worker_set(obj: api.VLLMDeployment, pods: Sequence[api.ReplicaPlacement], flags: api.Flags,
                      model_name: str, *, exclusive: Sequence[bool], weights_bytes: int = 0,
                      gated: Sequence[bool] = (), booked: Sequence[str] = (),
                      binding: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The LeaderWorkerSet of one replica: `pods` in rank order (the leader first), each with its
    binding choices (`exclusive`, `gated`, `booked` and `binding`'s further arguments — pins,
    runtime_class, mps, verify, revision —: per pod, as `builders.deployment` takes them). Its placement annotation
    is the group's (`builders.placement_text`), each pod's its own node's.
    Raises ValueError with `template_problem`'s line."""
    why = template_problem(pods)
    if why:
        raise ValueError(why)
    templates, meta = [], {}
    for k, p in enumerate(pods):
        d = builders.deployment(obj, p, flags, model_name, exclusive=exclusive[k], weights_bytes=weights_bytes,
                                gated=gated[k] if gated else False, booked=booked[k] if booked else "",
                                **(binding[k] if binding else {}))
        tpl = copy.deepcopy(d["spec"]["template"])
        meta = meta or d["metadata"]
        limits = tpl["spec"]["containers"][0]["resources"].get("limits") or {}
        if GPU_RESOURCE in limits:
            limits[GPU_RESOURCE] = len(p.gpus)  # a pod holds its own node's share of the group
        templates.append(tpl)
    leader, worker = templates[0], templates[1]
    c = leader["spec"]["containers"][0]
    c["command"] = ["sh", "-c", LEADER_SCRIPT, "vllm"]
    c["args"] = [*c["args"], "--distributed-executor-backend=ray"]  # builders.deployment's, --revision included
    w = worker["spec"]["containers"][0]
    w["command"] = ["sh", "-c", WORKER_SCRIPT]
    w["args"] = []
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        w.pop(probe, None)  # a worker serves no HTTP: the leader's probes speak for the group
    w.pop("ports", None)
    nodes = [p.node for p in pods[1:]]
    worker["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": nodes}]}]}},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [  # one pod of the group per node
            {"labelSelector": {"matchExpressions": [{"key": GROUP_LABEL, "operator": "Exists"}]},
             "matchLabelKeys": [GROUP_LABEL], "topologyKey": HOSTNAME}]},
    }
    meta["name"] = name(obj, pods[0].replica)
    meta["annotations"][builders.ANNOTATION_PLACEMENT] = builders.GROUP_JOIN.join(
        builders.placement_text(p) for p in sorted(pods, key=lambda q: q.node))  # by node, as the bookings
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": len(pods),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
