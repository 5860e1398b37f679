"""Pure builders: a VLLMDeployment and what vllmfit decided -> the objects and status to write.

No I/O and no Kopf here; the handlers call these and send the results to the API.

- `deployment` / `service`: the apps/v1 Deployment of one replica and the Service in front of all.
- `status`: the whole `.status` of a VLLMDeployment from its record and the ledger.
- `set_condition`: Kubernetes-convention conditions (lastTransitionTime moves only on change).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vllmfit.backends import binding, enforcement
from vllmfit.backends.binding import GPU_RESOURCE
from vllmfit.core import defaults, limits, memory
from vllmfit.core.placement import Booking, Ledger
from vllmfit.core.spec import api, extraargs, names, validate
from vllmfit.operator.rendering import podtemplate, verifier

PORT = 8000
MANAGED_BY = defaults.MANAGED_BY_LABEL
LABEL_DEPLOYMENT = defaults.DEPLOYMENT_LABEL
LABEL_REPLICA = f"{api.GROUP}/replica"
ANNOTATION_PLACEMENT = f"{api.GROUP}/placement"
GROUP_JOIN = " + "  # between the pods' placements of a replica across nodes (placement_text)
ANNOTATION_PINNING = f"{api.GROUP}/pinning"
# the bytes a replica's pod template was written for, per GPU ("0=123,1=123"): tells a resized
# replica's old pod from its new one at the same placement (operator/booking/draining.py)
ANNOTATION_BOOKED = f"{api.GROUP}/booked"
MAX_NAME = limits.MAX_DEPLOYMENT_NAME  # <name>-<replica> must stay a DNS label (63) with room for 6 digits

# `vllm serve` flags vllmfit computes or fixes, and those that change memory it does not model:
# vllmfit.core.spec.extraargs (checked with vLLM's own parsing rules: prefixes, --flag=value, aliases).
COMPUTED_FLAGS = extraargs.REFUSED


RESTRICTED_POD = podtemplate.RESTRICTED_POD
RESTRICTED_CONTAINER = podtemplate.RESTRICTED_CONTAINER
# A user with no /etc/passwd entry: $HOME must be writable, and getpass.getuser() (torch's
# compile caches) must not look the uid up.
RESTRICTED_ENV: tuple[dict[str, str], ...] = ({"name": "HOME", "value": defaults.VLLM_HOME},
                                              {"name": "USER", "value": "vllm"})


# --- Checks before placement -------------------------------------------------------------------


def extra_args_problems(args: Sequence[str]) -> list[str]:
    """One message per extraArgs entry that sets a flag vllmfit computes or fixes, or one that
    changes memory vllmfit does not model (vllmfit.core.spec.extraargs)."""
    return extraargs.messages(args)


def name_problem(name: str) -> str | None:
    return names.deployment_name_problem(name)


# --- Children ----------------------------------------------------------------------------------


def selector(name: str | None = None) -> str:
    """The label selector of what vllmfit made: everything, or what it made for VLLMDeployment `name`."""
    return f"{MANAGED_BY}=vllmfit" + (f",{LABEL_DEPLOYMENT}={name}" if name is not None else "")


def replica_of(meta: Mapping[str, Any]) -> tuple[str, int, str] | None:
    """(namespace/name, replica, placement) that a pod's or Deployment's metadata carries (the labels
    and the placement annotation written here); None where it is not a replica of vllmfit's."""
    labels = meta.get("labels") or {}
    name, replica = labels.get(LABEL_DEPLOYMENT), labels.get(LABEL_REPLICA)
    if not name or not replica or not str(replica).isdigit():
        return None
    where = (meta.get("annotations") or {}).get(ANNOTATION_PLACEMENT) or ""
    return f"{meta.get('namespace') or 'default'}/{name}", int(replica), str(where)


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/instance": name,
        MANAGED_BY: "vllmfit",
        LABEL_DEPLOYMENT: name,
    }


def deployment_name(name: str, replica: int) -> str:
    return f"{name}-{replica}"


def vllm_args(spec: api.VLLMDeploymentSpec, model_name: str, flags: api.Flags, revision: str = "") -> list[str]:
    """`vllm serve` arguments: the model, the computed flags, the spec's settings, extraArgs last.
    `revision`: the Hub commit the model's config was read at, pinned (`--revision`) unless extraArgs
    pins one (a commit too: vllmfit.core.spec.argclasses.COMMIT)."""
    out = [model_name, "--host=0.0.0.0", f"--port={PORT}", *flags.args(),
           f"--tensor-parallel-size={spec.tensor_parallel_size}",
           f"--pipeline-parallel-size={spec.pipeline_parallel_size}",
           f"--dtype={spec.dtype}", f"--kv-cache-dtype={spec.kv_cache_dtype}"]
    if spec.quantization:
        out.append(f"--quantization={spec.quantization}")
    if spec.enforce_eager:
        out.append("--enforce-eager")
    if spec.lora:
        out += memory.lora_args(spec.lora.max_loras, spec.lora.max_lora_rank, spec.lora.lora_dtype)
    if spec.cpu_offload_bytes:
        out.append(memory.cpu_offload_arg(spec.cpu_offload_bytes))
    if spec.max_num_batched_tokens and not any(a.startswith("--max-num-batched-tokens") for a in out):
        out.append(f"--max-num-batched-tokens={spec.max_num_batched_tokens}")
    if revision and not extraargs.values_of(spec.extra_args, "--revision"):
        out.append(f"--revision={revision}")
    return out + list(spec.extra_args)


def placement_text(p: api.ReplicaPlacement) -> str:
    """ANNOTATION_PLACEMENT: "node:0,1"; a replica across nodes, each pod's by node name, joined
    with " + " (draining.where_of gives the same text from the bookings)."""
    if p.workers:
        return GROUP_JOIN.join(placement_text(pod) for pod in sorted(p.pods(), key=lambda q: q.node))
    return f"{p.node}:{','.join(str(g.index) for g in p.gpus)}"


def booked_text(bookings: Iterable[Booking]) -> str:
    """ANNOTATION_BOOKED of one replica's bookings: GPU index = booked bytes, by index. The
    prediction the pods were written for: a booking that grows on measured use (issue 34) changes
    no pod (a rewrite would restart the vLLM it measured). A replica across nodes: each node's, by
    node name, joined with GROUP_JOIN (as placement_text; each of its pods carries its own node's)."""
    by_node: dict[str, list[Booking]] = {}
    for b in bookings:
        by_node.setdefault(b.node, []).append(b)
    return GROUP_JOIN.join(",".join(f"{b.index}={b.footprint.predicted}" for b in sorted(bs, key=lambda b: b.index))
                           for _, bs in sorted(by_node.items()))


def booked_bytes(text: str) -> list[int]:
    """The bytes of `booked_text`, in GPU index order ("0=123,1=456" -> [123, 456])."""
    return [int(part.split("=", 1)[1]) for part in text.split(",") if "=" in part]


def exclusive(ledger: Ledger, key: str, node: str, gpus: Iterable[int]) -> bool:
    """Whether a replica on `gpus` of `node` may be pinned with device-plugin limits: only when
    it takes every GPU of the node and nothing else is booked there, because the device plugin,
    not vllmfit, chooses which GPUs a `nvidia.com/gpu` limit gets."""
    info = ledger.nodes.get(node)
    if info is None or sorted(gpus) != sorted(s.index for s in info.gpus):
        return False
    return all(b.deployment == key for s in info.gpus for b in ledger.bookings_on(node, s.index))


def deployment(obj: api.VLLMDeployment, replica: api.ReplicaPlacement, flags: api.Flags, model_name: str,
               *, exclusive: bool, weights_bytes: int = 0, pins: Sequence[str] | None = None,
               gated: bool = False, claim_template: str | None = None,
               runtime_class: str | None = binding.RUNTIME_CLASS, booked: str = "",
               mps: binding.Mps | None = None, verify: verifier.Check | None = None,
               enforce: str = enforcement.NONE, revision: str = "") -> dict[str, Any]:
    """The Deployment running one replica, pinned to its node and GPUs, with the spec's
    podTemplate merged in (podtemplate.merge). The startup probe allows for loading
    `weights_bytes` (the replica's checkpoint) unless the template sets its timing. `booked`
    (booked_text) goes on the pods as ANNOTATION_BOOKED.

    exclusive: `nvidia.com/gpu` limits (the device plugin hands over the GPUs).
    shared: no GPU limits; NVIDIA_VISIBLE_DEVICES names the GPUs and the nvidia runtime class
    makes the NVIDIA container runtime inject exactly those (docs/operator.md, "GPU pinning").
    `mps`: the optional MPS binding; a shared replica then gets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT from
    `booked` (binding.Mps). `verify`: the model cache the tenant can write is checked by a last init
    container before vLLM starts (verifier.check_for). `enforce`: how a sharing replica's booking is
    enforced on its node (vllmfit.backends.enforcement), on its pods as enforcement.ANNOTATION.
    """
    spec = obj.spec
    name = obj.metadata.name
    n_gpus = spec.tensor_parallel_size * spec.pipeline_parallel_size
    pod_labels = {**labels(name), LABEL_REPLICA: str(replica.replica)}
    where = placement_text(replica)
    env: list[dict[str, Any]] = [dict(e) for e in spec.env]
    if spec.hf_token_secret_ref:
        ref = spec.hf_token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    resources = {k: dict(v) for k, v in (spec.resources or {}).items() if isinstance(v, dict)}
    for part in resources.values():
        part.pop(GPU_RESOURCE, None)
    gpu = binding.bind(replica, n_gpus, exclusive=exclusive, pins=pins, gated=gated, claim_template=claim_template,
                       runtime_class=runtime_class, mps=mps, booked=booked_bytes(booked), enforce=enforce)
    if gpu.limits:
        resources.setdefault("limits", {}).update(gpu.limits)
    if gpu.claims:
        resources["claims"] = [dict(c) for c in gpu.claims]
    env += gpu.env
    named = {e.get("name") for e in env}
    env += [e for e in RESTRICTED_ENV if e["name"] not in named] + [dict(e) for e in validate.FORCED_ENV]
    pod: dict[str, Any] = {"securityContext": copy.deepcopy(RESTRICTED_POD), **gpu.pod}
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    container = {
        "name": "vllm",
        "image": spec.image,
        "command": ["vllm", "serve"],
        "args": vllm_args(spec, model_name, flags, revision),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "startupProbe": podtemplate.startup_probe(weights_bytes, probe),
        "readinessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 20, "failureThreshold": 3},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *gpu.mounts],
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER),
    }
    pod.update({
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [replica.node]}]}]}}},
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, *gpu.volumes],  # NCCL / TP workers use /dev/shm
    })
    pod_meta: dict[str, Any] = {"labels": pod_labels, "annotations": {ANNOTATION_PLACEMENT: where, **gpu.annotations}}
    if booked:
        pod_meta["annotations"][ANNOTATION_BOOKED] = booked
    held = enforcement.of_pod(gpu.mode == binding.PIN_DEVICE_PLUGIN, gpu.mode == binding.PIN_VISIBLE_DEVICES,
                              enforce, mps is not None)
    if held in enforcement.ENFORCED:  # what holds it to its booking (an OverLimit reads it)
        pod_meta["annotations"][enforcement.ANNOTATION] = held
    podtemplate.merge(pod, pod_meta, spec.pod_template)
    if verify is not None:  # last: what the tenant's own init containers wrote is verified too
        pod["initContainers"] = [*pod.get("initContainers", []), verifier.init_container(verify, spec, env)]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(name, replica.replica),
            "namespace": obj.metadata.namespace,
            "labels": pod_labels,
            "annotations": {ANNOTATION_PLACEMENT: where, ANNOTATION_PINNING: gpu.mode},
        },
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # never two pods of a replica on its GPUs at once
            "selector": {"matchLabels": {LABEL_DEPLOYMENT: name, LABEL_REPLICA: str(replica.replica)}},
            "template": {
                "metadata": pod_meta,
                "spec": pod,
            },
        },
    }


def service(obj: api.VLLMDeployment) -> dict[str, Any]:
    name = obj.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": obj.metadata.namespace, "labels": labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": {MANAGED_BY: "vllmfit", LABEL_DEPLOYMENT: name},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


# --- Ledger queries ----------------------------------------------------------------------------


def neighbours(ledger: Ledger, gpus: Iterable[tuple[str, int]]) -> set[str]:
    return {b.deployment for node, i in gpus for b in ledger.bookings_on(node, i)}


def gpus_of(ledger: Ledger, key: str) -> set[tuple[str, int]]:
    return {(b.node, b.index) for b in ledger.bookings_of(key)}


