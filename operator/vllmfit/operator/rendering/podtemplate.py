"""The spec's podTemplate merged into a generated pod, and the startup probe. Pure.

vllmfit owns only what it must: the vLLM arguments it computes, the GPU binding (which node,
which GPUs, how they reach the container) and its labels. Everything else a platform needs
(tolerations, volumes, imagePullSecrets, serviceAccountName, priorityClassName, labels and
annotations, node affinity, securityContext, extra containers, probe timings) comes from the
template, within the allow-lists of vllmfit.core.spec.validate (the one validator the webhook, the
operator and `vllmfit plan` call): `merge` assumes a template that passed it.

Device access (issue 21): only the generated `vllm` container may reach a GPU, and only the GPUs
vllmfit booked for it. `merge` gives every other container `NVIDIA_VISIBLE_DEVICES=void`, so an
image whose own env says `all` (every CUDA base image) sees no GPU either, and every container
the restricted Pod Security defaults under what the template sets (`merge_security_context`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from vllmfit.core import defaults
from vllmfit.core.spec import api
from vllmfit.core.spec.validate import (  # noqa: F401 - the tables the builders and tests read here
    APPENDED_POD_LISTS,
    CONTAINER,
    OWNED_CONTAINER_FIELDS,
    SHM_VOLUME,
    VOID,
    is_device_env,
)

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")

# The restricted Pod Security Standard (https://kubernetes.io/docs/concepts/security/pod-security-standards/):
# a non-root user, no privilege escalation, no capabilities, the runtime's seccomp profile. vLLM needs
# none of what this takes away (the GPUs are device files the NVIDIA runtime opens for any user;
# NCCL uses the /dev/shm emptyDir). A podTemplate securityContext is merged over these, field by
# field, within the chart's Pod Security level (vllmfit.core.spec.validate).
RESTRICTED_POD: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": defaults.VLLM_RUN_AS_USER,
    "runAsGroup": defaults.VLLM_RUN_AS_USER,
    "fsGroup": defaults.VLLM_RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def merge_security_context(ours: Mapping[str, Any], theirs: Any) -> dict[str, Any]:
    """`theirs` over `ours`, field by field (capabilities too: an `add` keeps our `drop`)."""
    if not isinstance(theirs, Mapping):
        return copy.deepcopy(dict(ours))
    out = {**copy.deepcopy(dict(ours)), **copy.deepcopy(dict(theirs))}
    if isinstance(ours.get("capabilities"), Mapping) and isinstance(theirs.get("capabilities"), Mapping):
        out["capabilities"] = {**copy.deepcopy(dict(ours["capabilities"])), **copy.deepcopy(dict(theirs["capabilities"]))}
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
    container but vllm's `NVIDIA_VISIBLE_DEVICES=void` (`neutralize`). The template must have passed
    vllmfit.core.spec.validate (nothing here overrides what vllmfit owns). Raises only TemplateError."""
    try:
        if template is not None:
            _merge(pod, pod_meta, template)
    except (AttributeError, TypeError, KeyError, ValueError, StopIteration) as e:
        raise TemplateError(f"podTemplate cannot be merged: {type(e).__name__}: {str(e)[:200]}") from None
    neutralize(pod)


def neutralize(pod: dict[str, Any]) -> None:
    """`NVIDIA_VISIBLE_DEVICES=void` in every container and init container but vllm's, replacing
    any value (an image's own ENV, envFrom and earlier entries lose to the last env entry), and the
    restricted container defaults under whatever securityContext the template gave it."""
    for field in ("initContainers", "containers"):
        for c in pod.get(field) or []:
            if not isinstance(c, dict) or (field == "containers" and c.get("name") == CONTAINER):
                continue
            env = [e for e in c.get("env") or [] if not (isinstance(e, Mapping) and is_device_env(e.get("name")))]
            c["env"] = [*env, {"name": "NVIDIA_VISIBLE_DEVICES", "value": VOID}]
            c["securityContext"] = merge_security_context(RESTRICTED_CONTAINER, c.get("securityContext"))


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
    if "securityContext" in spec:
        pod["securityContext"] = merge_security_context(pod.get("securityContext") or {}, spec.pop("securityContext"))
    pod.update(spec)  # serviceAccountName, priorityClassName, ...


def _merge_container(vllm: dict[str, Any], c: dict[str, Any]) -> None:
    c.pop("name", None)
    mounts = c.pop("volumeMounts", [])
    if mounts:
        vllm["volumeMounts"] = [*vllm.get("volumeMounts", []), *mounts]
    for probe in PROBES:
        if probe in c:
            vllm[probe] = {**vllm.get(probe, {}), **c.pop(probe)}
    if "securityContext" in c:
        vllm["securityContext"] = merge_security_context(vllm.get("securityContext") or {}, c.pop("securityContext"))
    vllm.update(c)  # imagePullPolicy, envFrom, ...
