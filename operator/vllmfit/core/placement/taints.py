"""Taints, cordons and tolerations, which placement honours like the kube-scheduler (issue 21 item 7).

A node whose `spec.unschedulable` is set (`kubectl cordon`) or that carries a NoSchedule or
NoExecute taint the pod does not tolerate gets no new booking: its pods could never run. Existing
bookings stay (a cordon or a NoSchedule taint does not evict running pods; a NoExecute taint's
evictions are the kubelet's, and the operator sees the pods go).

The pod's tolerations are what vllmfit writes (the `nvidia.com/gpu` toleration of every GPU pod),
those of `spec.podTemplate.spec.tolerations`, and the two the DefaultTolerationSeconds admission
plugin adds to every pod (not-ready and unreachable, NoExecute). Matching follows Kubernetes
(k8s.io/api/core/v1 Toleration.ToleratesTaint): an empty effect matches every effect; `Exists`
with an empty key matches every taint; `Equal` (the default operator) needs the same key and
value. PreferNoSchedule never excludes. A cordon is the taint `node.kubernetes.io/unschedulable:
NoSchedule` (the NodeUnschedulable plugin checks exactly that toleration).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllmfit.core.spec.api import VLLMDeploymentSpec

UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
EXCLUDING = ("NoSchedule", "NoExecute")
MAX_TAINTS = 64
MAX_TOLERATIONS = 64
MAX_TEXT = 317  # a qualified key: 253 (prefix) + 1 + 63 (name); values are at most 63


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def text(self) -> str:
        """As the kube-scheduler prints it: `{key: value}`."""
        return f"{{{self.key}: {self.value}}}"


@dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, t: Taint) -> bool:
        if self.effect and self.effect != t.effect:
            return False
        if self.key and self.key != t.key:
            return False
        if self.operator == "Exists":
            return True
        return self.operator == "Equal" and bool(self.key) and self.value == t.value


GPU_TOLERATION = Toleration("nvidia.com/gpu", "Exists", "", "NoSchedule")
"""What vllmfit writes on its replica and reservation pods (builders, backends.reservation)."""
DEFAULT_TOLERATIONS = (Toleration("node.kubernetes.io/not-ready", "Exists", "", "NoExecute"),
                       Toleration("node.kubernetes.io/unreachable", "Exists", "", "NoExecute"))
"""Added to every pod by the DefaultTolerationSeconds admission plugin (with tolerationSeconds)."""


def _text(v: Any) -> str:
    return v[:MAX_TEXT] if isinstance(v, str) else ""


def read_taints(spec: Any) -> tuple[tuple[Taint, ...], bool, str | None]:
    """(taints, unschedulable, problem) of a v1 Node's spec, never raising: malformed entries are
    skipped, more than MAX_TAINTS is a problem (the node then counts as unschedulable: a node
    whose taints cannot be read is not given new bookings)."""
    if not isinstance(spec, Mapping):
        return (), False, None
    unschedulable = spec.get("unschedulable") is True
    raw = spec.get("taints")
    if raw is None:
        return (), unschedulable, None
    if not isinstance(raw, list) or len(raw) > MAX_TAINTS:
        return (), True, f"spec.taints is not a list of at most {MAX_TAINTS} taints; no new bookings"
    out = []
    for t in raw:
        if isinstance(t, Mapping) and _text(t.get("key")) and t.get("effect") in (*EXCLUDING, "PreferNoSchedule"):
            out.append(Taint(_text(t["key"]), _text(t.get("value")), str(t["effect"])))
    return tuple(sorted(set(out), key=lambda t: (t.key, t.value, t.effect))), unschedulable, None


def tolerations_of(spec: VLLMDeploymentSpec) -> tuple[Toleration, ...]:
    """The tolerations the spec's pods carry (vllmfit's, the template's, the admission defaults),
    hashable. A malformed entry tolerates nothing (the CRD types refuse it anyway)."""
    tpl = spec.pod_template
    raw = (tpl.spec or {}).get("tolerations") if tpl is not None else None
    out = [GPU_TOLERATION, *DEFAULT_TOLERATIONS]
    for t in (raw if isinstance(raw, list) else [])[:MAX_TOLERATIONS]:
        if isinstance(t, Mapping):
            op = t.get("operator") or "Equal"
            if op in ("Equal", "Exists"):
                out.append(Toleration(_text(t.get("key")), op, _text(t.get("value")), _text(t.get("effect"))))
    return tuple(dict.fromkeys(out))


def untolerated(taints: Iterable[Taint], unschedulable: bool, tolerations: Iterable[Toleration]) -> str | None:
    """Why a node takes no new pod with these tolerations (the kube-scheduler's words), or None."""
    tol = tuple(tolerations)
    cordon = Taint(UNSCHEDULABLE_TAINT, "", "NoSchedule")
    if unschedulable and not any(x.tolerates(cordon) for x in tol):
        return "node(s) were unschedulable"
    for t in taints:
        if t.effect in EXCLUDING and not any(x.tolerates(t) for x in tol):
            return f"node(s) had untolerated taint {t.text()}"
    return None
