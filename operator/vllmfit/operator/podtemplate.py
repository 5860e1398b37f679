"""The spec's podTemplate: what it may not set, and how it is merged into a generated pod. Pure.

vllmfit owns only what it must: the vLLM arguments it computes, the GPU binding (which node,
which GPUs, how they reach the container) and its labels. Everything else a platform needs
(tolerations, volumes, imagePullSecrets, serviceAccountName, priorityClassName, labels and
annotations, node affinity, securityContext, extra containers, probe timings) comes from the
template. A template field that would fight vllmfit is refused with the spec field to use.

Device access (issue 21): only the generated `vllm` container may reach a GPU, and only the GPUs
vllmfit booked for it. `device_access_problems` refuses every template field that would give any
container another way in (a GPU resource on a sidecar, the NVIDIA container toolkit's env on a
sidecar, `privileged`, hostPID/hostIPC/shareProcessNamespace, hostPath mounts of /dev, /proc,
/sys or the driver's directories, CDI annotations); `merge` then forces
`NVIDIA_VISIBLE_DEVICES=void` into every other container, so an image whose own env says `all`
(every CUDA base image) sees no GPU either. The webhook and the operator both apply these rules
(builders.spec_problems), so a webhook that is down or `Ignore` changes nothing.
"""

from __future__ import annotations

import copy
import math
import posixpath
from collections.abc import Mapping
from typing import Any

from vllmfit.backends.binding import GPU_RESOURCE
from vllmfit.core import defaults
from vllmfit.core.spec import api
from vllmfit.sources import catalog

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

# --- Device access: what gives a container a GPU besides vllmfit's binding -------------------------

VOID = "void"
"""NVIDIA_VISIBLE_DEVICES value that gives a container no GPU (NVIDIA container toolkit, legacy and
CDI modes); forced into every container but vllm's."""
# The NVIDIA container toolkit reads these from a container's env to decide which devices and
# control files it injects (GPUs, driver capabilities, MIG/IMEX/NVSwitch/GDS/MOFED devices).
# NVIDIA_REQUIRE_* and NVIDIA_DISABLE_REQUIRE only constrain, and CUDA_VISIBLE_DEVICES only
# filters what a process already sees: none gives access, so they stay allowed on sidecars.
DEVICE_ENV = frozenset({
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_MIG_CONFIG_DEVICES",
    "NVIDIA_MIG_MONITOR_DEVICES", "NVIDIA_IMEX_CHANNELS", "NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_NVSWITCH",
    "NVIDIA_GDRCOPY",
})
# Extended resources that hand a container an accelerator (any resource of these domains).
GPU_RESOURCE_PREFIXES = ("nvidia.com/", "amd.com/", "gpu.intel.com/", "habana.ai/", "aws.amazon.com/neuron",
                         "google.com/tpu", "xilinx.com/", "qualcomm.com/", "huawei.com/ascend", "hami.io/")
# Host paths whose mount reaches the GPUs' device files or the driver's control files.
HOST_PATHS = ("/dev", "/proc", "/sys", "/run/nvidia", "/var/run/nvidia", "/run/cdi", "/var/run/cdi", "/etc/cdi",
              "/var/lib/kubelet", "/usr/lib/nvidia", "/usr/local/nvidia", "/home/kubernetes/bin/nvidia")
# Pod fields that open another container's (vLLM's) processes or the host's.
HOST_POD_FIELDS = ("hostPID", "hostIPC", "shareProcessNamespace")
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"


def is_gpu_resource(name: str) -> bool:
    return any(str(name).startswith(p) for p in GPU_RESOURCE_PREFIXES)


def is_device_env(name: Any) -> bool:
    return isinstance(name, str) and name in DEVICE_ENV


def _host_path_problem(path: Any) -> bool:
    if not isinstance(path, str) or not path:
        return True
    p = posixpath.normpath("/" + path.strip().lstrip("/"))
    return p == "/" or any(p == h or p.startswith(h + "/") for h in HOST_PATHS)


def device_access_problems(pod: Mapping[str, Any], annotations: Mapping[str, Any] | None = None) -> list[str]:
    """One line per field of a pod spec fragment (and its annotations) that would give a container
    GPU access vllmfit did not book: naming the field and why. Pure; never raises."""
    out = []
    for key in sorted(annotations or {}):
        if str(key).startswith(CDI_ANNOTATION_PREFIX):
            out.append(f"podTemplate.metadata.annotations[{key}]: CDI annotations inject devices into containers; "
                       "only vllmfit's GPU binding may; remove it")
    for field in HOST_POD_FIELDS:
        if pod.get(field) is True:
            out.append(f"{PREFIX}.{field}: true lets a container reach the GPU processes of other containers or "
                       "the host; remove it")
    for i, v in enumerate(pod.get("volumes") or []):
        if isinstance(v, Mapping) and isinstance(v.get("hostPath"), Mapping) and _host_path_problem(
                v["hostPath"].get("path")):
            out.append(f"{PREFIX}.volumes[{v.get('name', i)}].hostPath.path {str(v['hostPath'].get('path'))[:80]!r}: "
                       "host paths under /dev, /proc, /sys and the NVIDIA driver's directories reach the GPUs; "
                       "remove it")
    if pod.get("ephemeralContainers"):
        out.append(f"{PREFIX}.ephemeralContainers: not allowed in a pod template; remove it")
    for field in ("initContainers", "containers"):
        for i, c in enumerate(pod.get(field) or []):
            if not isinstance(c, Mapping):
                continue
            name = c.get("name") if isinstance(c.get("name"), str) else str(i)
            where = f"{PREFIX}.{field}[{name}]"
            sc = c.get("securityContext")
            if isinstance(sc, Mapping) and sc.get("privileged") is True:
                out.append(f"{where}.securityContext.privileged: a privileged container sees every GPU of the node; "
                           "remove it")
            if field == "containers" and name == CONTAINER:
                continue
            for e in c.get("env") or []:
                if isinstance(e, Mapping) and is_device_env(e.get("name")):
                    out.append(f"{where}.env[{e['name']}]: only the {CONTAINER} container may see GPUs (vllmfit "
                               f"sets {VOID} here); remove it")
            resources = c.get("resources")
            if isinstance(resources, Mapping):
                for part in ("limits", "requests"):
                    for r in sorted(resources.get(part) or {}) if isinstance(resources.get(part), Mapping) else ():
                        if is_gpu_resource(r):
                            out.append(_use(f"{where}.resources.{part}[{r}]", None,
                                            f"only the {CONTAINER} container gets GPUs, through its binding"))
                if resources.get("claims"):
                    out.append(_use(f"{where}.resources.claims", None))
    return out


def _use(field: str, use: str | None, why: str = "vllmfit's GPU binding sets it") -> str:
    return f"{field} is set by vllmfit; use {use} instead" if use else f"{field} is set by vllmfit ({why}); remove it"


def model_config_problem(spec: api.VLLMDeploymentSpec) -> str | None:
    """Inline `modelConfig` (or `modelConfigRef`) is not trusted for a model vllmfit knows
    (issue 21 item 4): vLLM loads the real config of a catalog model, so a smaller config written
    by a tenant would only make vllmfit book less than the server takes, next to other tenants'
    servers. For a model vllmfit does not know (a private repository, a local path) the spec's
    config is all it has, and it is used (docs/webhook.md, "What vllmfit believes")."""
    if spec.model_config_inline is None and spec.model_config_ref is None:
        return None
    try:
        catalog.model(spec.model)
    except LookupError:
        return None
    field = "spec.modelConfig" if spec.model_config_inline is not None else "spec.modelConfigRef"
    return (f"{field}: {spec.model} is in vllmfit's catalog, whose config is what vLLM loads; remove {field} "
            "(a config that differs from the real one would book the wrong memory)")


def problems(spec: api.VLLMDeploymentSpec) -> list[str]:
    """One message per podTemplate (or spec.env) field that fights what vllmfit owns, and a
    modelConfig vllmfit does not trust (`model_config_problem`)."""
    out = [p for p in [model_config_problem(spec)] if p]
    out += [f"spec.env {e.get('name')} is set by vllmfit's GPU binding; use spec.placement.gpuIndices to choose GPUs"
           for e in spec.env if e.get("name") in BINDING_ENV or is_device_env(e.get("name"))]
    for part, values in sorted((spec.resources or {}).items()):
        if isinstance(values, Mapping):
            out += [f"spec.resources.{part}[{r}]: GPUs are given by vllmfit's binding (the GPUs it booked); remove it"
                    for r in sorted(values) if is_gpu_resource(r) and r != GPU_RESOURCE]
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
    out += device_access_problems(pod, meta.annotations)
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


class TemplateError(ValueError):
    """A podTemplate that cannot be merged (one line naming the field): that spec's error, never
    the operator's."""


def merge(pod: dict[str, Any], pod_meta: dict[str, Any], template: api.PodTemplate | None) -> None:
    """Merge `template` into a generated pod spec and its metadata, in place, then give every
    container but vllm's `NVIDIA_VISIBLE_DEVICES=void` (`neutralize`). `problems` must be empty
    for it (nothing here overrides what vllmfit owns). Raises only TemplateError."""
    try:
        if template is not None:
            _merge(pod, pod_meta, template)
    except (AttributeError, TypeError, KeyError, ValueError, StopIteration) as e:
        raise TemplateError(f"podTemplate cannot be merged: {type(e).__name__}: {str(e)[:200]}") from None
    neutralize(pod)


def neutralize(pod: dict[str, Any]) -> None:
    """`NVIDIA_VISIBLE_DEVICES=void` in every container and init container but vllm's, replacing
    any value (an image's own ENV, envFrom and earlier entries lose to the last env entry)."""
    for field in ("initContainers", "containers"):
        for c in pod.get(field) or []:
            if not isinstance(c, dict) or (field == "containers" and c.get("name") == CONTAINER):
                continue
            env = [e for e in c.get("env") or [] if not (isinstance(e, Mapping) and is_device_env(e.get("name")))]
            c["env"] = [*env, {"name": "NVIDIA_VISIBLE_DEVICES", "value": VOID}]


def _merge(pod: dict[str, Any], pod_meta: dict[str, Any], template: api.PodTemplate) -> None:
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
