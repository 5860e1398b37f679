"""The spec's podTemplate: what it may not set, and how it is merged into a generated pod. Pure.

vllmfit owns only what it must: the vLLM arguments it computes, the GPU binding (which node,
which GPUs, how they reach the container) and its labels. Everything else a platform needs
(tolerations, volumes, imagePullSecrets, serviceAccountName, priorityClassName, labels and
annotations, node affinity, securityContext, extra containers, probe timings) comes from the
template. A template field that would fight vllmfit is refused with the spec field to use.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from vllmfit.backends.binding import GPU_RESOURCE
from vllmfit.core import defaults
from vllmfit.core.spec import api

CONTAINER = "vllm"
SHM_VOLUME = "dshm"
PREFIX = "podTemplate.spec"

# PodSpec fields vllmfit sets -> what to use instead (None: nothing; vllmfit's GPU binding owns it).
OWNED_POD_FIELDS: dict[str, str | None] = {
    "nodeName": "spec.placement.nodeName",
    "nodeSelector": "spec.placement.nodeSelector (or a required nodeAffinity in podTemplate.spec.affinity)",
    "runtimeClassName": None,
    "resourceClaims": None,
    "schedulingGates": None,  # the reservation gate the operator lifts (backends/reservation.py)
}
# Fields of the vllm container vllmfit sets -> what to use instead.
OWNED_CONTAINER_FIELDS: dict[str, str | None] = {
    "image": "spec.image",
    "command": "spec.extraArgs",
    "args": "spec.extraArgs (the computed flags have their own spec fields)",
    "env": "spec.env",
    "resources": "spec.resources",
    "ports": None,
}
# Lists of the pod and of the vllm container that vllmfit fills and the template extends.
APPENDED_POD_LISTS = ("tolerations", "volumes", "imagePullSecrets", "initContainers", "containers", "schedulingGates")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
BINDING_ENV = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")
OWNED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", defaults.MANAGED_BY_LABEL)


def _use(field: str, use: str | None, why: str = "vllmfit's GPU binding sets it") -> str:
    return f"{field} is set by vllmfit; use {use} instead" if use else f"{field} is set by vllmfit ({why}); remove it"


def _gpu_resources(container: Mapping[str, Any], where: str) -> list[str]:
    out = []
    resources = container.get("resources")
    if isinstance(resources, Mapping):
        for part in ("limits", "requests"):
            if isinstance(resources.get(part), Mapping) and GPU_RESOURCE in resources[part]:
                out.append(_use(f"{where}.resources.{part}[{GPU_RESOURCE}]", None,
                                f"only the {CONTAINER} container gets GPUs, through its binding"))
        if resources.get("claims"):
            out.append(_use(f"{where}.resources.claims", None))
    return out


def problems(spec: api.VLLMDeploymentSpec) -> list[str]:
    """One message per podTemplate (or spec.env) field that fights what vllmfit owns."""
    out = [f"spec.env {e.get('name')} is set by vllmfit's GPU binding; use spec.placement.gpuIndices to choose GPUs"
           for e in spec.env if e.get("name") in BINDING_ENV]
    tpl = spec.pod_template
    if tpl is None:
        return out
    meta = tpl.metadata or api.PodTemplateMetadata()
    for kind, values in (("labels", meta.labels), ("annotations", meta.annotations)):
        for key in sorted(values or {}):
            if key.startswith(f"{api.GROUP}/") or (kind == "labels" and key in OWNED_LABELS):
                out.append(_use(f"podTemplate.metadata.{kind}[{key}]", None, "the operator and the Service select by it"
                                if kind == "labels" else "it records the placement"))
    pod = tpl.spec or {}
    for field, use in OWNED_POD_FIELDS.items():
        if field in pod:
            out.append(_use(f"{PREFIX}.{field}", use))
    for field in APPENDED_POD_LISTS:
        if field in pod and not isinstance(pod[field], list):
            out.append(f"{PREFIX}.{field} must be a list")
    if out:
        return out
    for v in pod.get("volumes") or []:
        if isinstance(v, Mapping) and v.get("name") == SHM_VOLUME:
            out.append(f"{PREFIX}.volumes[{SHM_VOLUME}]: the name {SHM_VOLUME} is vllmfit's /dev/shm volume; "
                       "use another name")
    for field in ("initContainers", "containers"):
        for i, c in enumerate(pod.get(field) or []):
            if not isinstance(c, Mapping) or not isinstance(c.get("name"), str):
                out.append(f"{PREFIX}.{field}[{i}] must be a container with a name")
                continue
            where = f"{PREFIX}.{field}[{c['name']}]"
            if field == "containers" and c["name"] == CONTAINER:
                out += _vllm_container_problems(c, where)
            else:
                out += _gpu_resources(c, where)
    return out


def _vllm_container_problems(c: Mapping[str, Any], where: str) -> list[str]:
    out = []
    for field, use in OWNED_CONTAINER_FIELDS.items():
        if field in c:
            out.append(_use(f"{where}.{field}", use, "the Service and probes use port 8000"))
    for m in c.get("volumeMounts") or []:
        if isinstance(m, Mapping) and m.get("mountPath") == "/dev/shm":
            out.append(f"{where}.volumeMounts: /dev/shm is vllmfit's memory-backed mount (NCCL needs it); remove it")
    for probe in PROBES:
        if probe in c and not isinstance(c[probe], Mapping):
            out.append(f"{where}.{probe} must be an object")
    return out


# --- Startup probe --------------------------------------------------------------------------------


def startup_seconds(weights_bytes: int) -> int:
    """How long vLLM may take to start: a fixed part (engine start-up, CUDA graphs, compilation)
    plus downloading and loading the checkpoint at an assumed rate (core/defaults.py)."""
    return defaults.STARTUP_BASE_SECONDS + math.ceil(weights_bytes / defaults.STARTUP_LOAD_BYTES_PER_SECOND)


def startup_probe(weights_bytes: int, probe: Mapping[str, Any]) -> dict[str, Any]:
    """The startup probe: failureThreshold x periodSeconds covers `startup_seconds`."""
    period = defaults.STARTUP_PROBE_PERIOD_SECONDS
    return {**probe, "periodSeconds": period, "failureThreshold": math.ceil(startup_seconds(weights_bytes) / period)}


# --- Merge ----------------------------------------------------------------------------------------


def _and_pin(required: Mapping[str, Any], pin: Mapping[str, Any]) -> dict[str, Any]:
    """The template's required node affinity ANDed with vllmfit's pin to one node: the pin's
    requirements are added to every term (terms are ORed, requirements inside one ANDed)."""
    terms = []
    for term in required.get("nodeSelectorTerms") or []:
        t = copy.deepcopy(dict(term))
        t["matchFields"] = [*t.get("matchFields", []), *pin["matchFields"]]
        terms.append(t)
    return {"nodeSelectorTerms": terms}


def merge(pod: dict[str, Any], pod_meta: dict[str, Any], template: api.PodTemplate | None) -> None:
    """Merge `template` into a generated pod spec and its metadata, in place. `problems` must
    be empty for it (nothing here overrides what vllmfit owns)."""
    if template is None:
        return
    meta = template.metadata or api.PodTemplateMetadata()
    if meta.labels:
        pod_meta["labels"] = {**meta.labels, **pod_meta.get("labels", {})}
    if meta.annotations:
        pod_meta["annotations"] = {**meta.annotations, **pod_meta.get("annotations", {})}
    spec = copy.deepcopy(template.spec or {})
    vllm = next(c for c in pod["containers"] if c["name"] == CONTAINER)
    extra = [c for c in spec.pop("containers", []) if c.get("name") != CONTAINER]
    for c in template.spec.get("containers", []) if template.spec else []:
        if c.get("name") == CONTAINER:
            _merge_container(vllm, copy.deepcopy(c))
    for field in APPENDED_POD_LISTS:
        items = extra if field == "containers" else spec.pop(field, [])
        if items:
            pod[field] = [*pod.get(field, []), *items]
    affinity = spec.pop("affinity", None)
    if affinity:
        mine = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
        merged = copy.deepcopy(affinity)
        node_affinity = merged.setdefault("nodeAffinity", {})
        required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
        if mine is not None:
            pin = mine["nodeSelectorTerms"][0]
            node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = (
                _and_pin(required, pin) if required else copy.deepcopy(mine))
        pod["affinity"] = merged
    pod.update(spec)  # serviceAccountName, priorityClassName, securityContext, ...


def _merge_container(vllm: dict[str, Any], c: dict[str, Any]) -> None:
    c.pop("name", None)
    mounts = c.pop("volumeMounts", [])
    if mounts:
        vllm["volumeMounts"] = [*vllm.get("volumeMounts", []), *mounts]
    for probe in PROBES:
        if probe in c:
            vllm[probe] = {**vllm.get(probe, {}), **c.pop(probe)}
    vllm.update(c)  # securityContext, imagePullPolicy, envFrom, lifecycle, ...
