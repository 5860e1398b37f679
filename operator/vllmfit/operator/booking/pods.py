"""Pod status -> is this vLLM replica serving, and if not, why. Pure: dicts in, dataclasses out.

`pod_health(pod, log_tail)` reads one pod (the JSON of a v1/Pod). When its vLLM container
exited with an error, it asks for the last lines of the container's log (`needs_log`); called
again with them, it finds the line that explains the failure ("CUDA out of memory", a Python
exception). `summarize` folds the pods of all replicas into the deployment's Ready condition.

Failed (phase Failed) means it will not recover by itself: the kernel OOM killer (host memory)
or CUDA running out of GPU memory at start-up. Crash loops for other reasons, image pull
errors and pending pods are Ready=False with the reason, but may recover.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllmfit.backends import enforcement
from vllmfit.operator.rendering import verifier

CONTAINER = "vllm"

GPU_OOM_PATTERNS = (
    "CUDA out of memory",
    "OutOfMemoryError",
    "CUDA error: out of memory",
    "No available memory for the cache blocks",
    "larger than the available KV cache memory",
)
ERROR_PATTERNS = ("Error", "error:", "Exception", "FATAL", "Traceback")
IMAGE_ERRORS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}


@dataclass(frozen=True)
class PodHealth:
    ready: bool
    reason: str  # CamelCase, as in conditions
    message: str
    failed: bool = False  # will not recover by itself
    needs_log: bool = False  # call again with the container's last log lines


def _container_status(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for cs in statuses:
        if cs.get("name") == CONTAINER:
            return cs
    return statuses[0] if statuses else None


def log_line(log_tail: str) -> tuple[bool, str]:
    """(GPU out of memory?, the most telling line) of a log tail: the last line matching an
    out-of-memory pattern, else the last line that looks like an error, else the last line."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(p in ln for p in GPU_OOM_PATTERNS):
            return True, ln
    for ln in reversed(lines):
        if any(p in ln for p in ERROR_PATTERNS):
            return False, ln
    return False, lines[-1] if lines else ""


def _cache_refused(status: Mapping[str, Any]) -> str | None:
    """Why the model-cache verifier failed the pod (its termination message), or None."""
    for cs in status.get("initContainerStatuses") or []:
        if cs.get("name") != verifier.NAME:  # the init container that verifies a tenant-writable cache
            continue
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            term = state.get("terminated") or {}
            if term and term.get("exitCode", 0) != 0:
                return str(term.get("message") or f"the verifier exited with code {term.get('exitCode')}").strip()
    return None


def pod_health(pod: Mapping[str, Any], log_tail: str | None = None) -> PodHealth:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return PodHealth(False, "Terminating", "pod is terminating")
    if (why := _cache_refused(status)) is not None:  # vLLM never starts on a cache that is not what was sized
        return PodHealth(False, "ModelCacheRefused", why[:1000], True)
    if status.get("phase") == "Failed":  # evicted, rejected by the kubelet: the Deployment replaces it
        return PodHealth(False, status.get("reason") or "PodFailed", status.get("message") or "pod failed")
    cs = _container_status(pod)
    if cs is None:
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return PodHealth(False, c.get("reason") or "Unschedulable", c.get("message") or "pod not scheduled")
        return PodHealth(False, "Pending", "waiting for the vLLM container to be created")
    state = cs.get("state") or {}
    waiting = state.get("waiting") or {}
    term = state.get("terminated") or ((cs.get("lastState") or {}).get("terminated") if waiting else None) or {}
    restarts = int(cs.get("restartCount") or 0)
    if term.get("reason") == "OOMKilled":
        return PodHealth(False, "OOMKilled", f"vLLM container was OOMKilled (exit code {term.get('exitCode', 137)}, "
                         f"{restarts} restarts): it ran out of host memory; raise spec.resources.limits.memory", True)
    if term and term.get("exitCode", 0) != 0:
        if log_tail is None:
            return PodHealth(False, waiting.get("reason") or "Error",
                             term.get("message") or f"vLLM exited with code {term.get('exitCode')}", needs_log=True)
        oom, line = log_line(log_tail)
        held = (meta.get("annotations") or {}).get(enforcement.ANNOTATION)
        if oom and held in enforcement.ENFORCED:  # its limit stopped it; its neighbours keep their memory
            return PodHealth(False, "OverLimit", f"vLLM was stopped at its GPU memory limit ({held}): {line}", True)
        if oom:
            return PodHealth(False, "CudaOutOfMemory", f"vLLM ran out of GPU memory: {line}", True)
        what = line or term.get("message") or f"exit code {term.get('exitCode')}"
        return PodHealth(False, waiting.get("reason") or "Error", f"vLLM exited ({restarts} restarts): {what}")
    if waiting:
        reason = waiting.get("reason") or "Waiting"
        if reason in IMAGE_ERRORS:
            return PodHealth(False, "ImagePullBackOff", waiting.get("message") or f"cannot pull the image ({reason})")
        if reason == "ContainerCreating":
            return PodHealth(False, "Starting", "container is being created")
        return PodHealth(False, reason, waiting.get("message") or reason)
    if "running" in state:
        if cs.get("ready"):
            return PodHealth(True, "Serving", "vLLM answers /health")
        return PodHealth(False, "Starting", "vLLM is loading the model (waiting for /health)")
    if term:  # exited with 0: vLLM does not exit by itself while serving
        return PodHealth(False, term.get("reason") or "Completed", "vLLM exited")
    return PodHealth(False, "Pending", "waiting for the vLLM container")


def summarize(replica_health: Iterable[tuple[int, PodHealth]], expected: int) -> PodHealth:
    """The deployment's health from (replica, pod health) of all its pods: ready when every
    replica 0..expected-1 has a ready pod and no pod is failing."""
    items = list(replica_health)
    failed = [h for _, h in items if h.failed]
    if failed:
        return failed[0]
    ready_replicas = {r for r, h in items if h.ready}
    broken = [h for _, h in items if not h.ready and h.reason not in ("Starting", "Pending", "Terminating")]
    if expected > 0 and all(r in ready_replicas for r in range(expected)) and not broken:
        n = len(ready_replicas)
        return PodHealth(True, "Serving", f"{n}/{expected} replica{'s' if expected > 1 else ''} ready")
    if broken:
        return broken[0]
    waiting = [h for _, h in items if not h.ready]
    if waiting:
        return waiting[0]
    return PodHealth(False, "Pending", f"{len(ready_replicas)}/{expected} replicas ready; waiting for pods")
