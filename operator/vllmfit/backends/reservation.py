"""Device-plugin backend: GPU reservation pods (KAI-Scheduler's pattern), as pure functions.

Where GPUs are handed out by the NVIDIA device plugin, a replica that shares a GPU (or uses some
GPUs of a node without taking all of them) cannot ask for `nvidia.com/gpu`: the plugin would pick
the GPU, and two replicas sharing one GPU would each take a whole one. So for every such GPU
vllmfit first creates one *reservation pod* on the node that requests `nvidia.com/gpu: 1` and
does nothing else. The device plugin and the scheduler then count that GPU as used, like any
other pod's. The reservation container reports which physical GPU the plugin gave it (its own
NVML view: exactly one GPU, its UUID) by patching the annotation `vllmfit.dev/gpu-uuid` on its
own pod; vllmfit books and pins the replicas to that UUID. Replica pods carry a scheduling gate
until every GPU they are pinned to is held by a reservation that reported that UUID.

Identity: a reservation is asked for one GPU slot (`vllmfit.dev/reserve-node`,
`vllmfit.dev/reserve-gpu` annotations: the ledger's node and index), but once it has reported,
what it holds is the GPU with the reported UUID, whatever it was asked for. Everything here
works from that rule:

  Known            the reservations the operator knows, by name, by node, and those that reported
  held_uuids       the GPUs a node's reservations hold (reported UUIDs)
  slots_held       which ledger slots are held or being reserved, and which slot each
                   reservation ends up serving
  mismatch         a reservation that got another GPU than the one asked for (re-book there)
  swap_bookings    the ledger entries of a node with two GPUs exchanged
  plan             which reservations to create and which to delete
  pins             the UUIDs a replica is pinned to (None: not known yet; the pod stays gated)
  reservation_pod  the manifest
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllmfit import __version__
from vllmfit.core import defaults
from vllmfit.core.placement import Booking
from vllmfit.core.spec import api

GPU_RESOURCE = defaults.GPU_RESOURCE
MANAGED_BY = "app.kubernetes.io/managed-by"
ROLE_LABEL = f"{api.GROUP}/role"
ROLE = "gpu-reservation"
ANNOTATION_NODE = f"{api.GROUP}/reserve-node"
ANNOTATION_INDEX = f"{api.GROUP}/reserve-gpu"
ANNOTATION_UUID = f"{api.GROUP}/gpu-uuid"
"""Written by the reservation container on its own pod: the UUID of the one GPU it sees."""
ANNOTATION_PINS = f"{api.GROUP}/gpus"
"""On a replica's pod: the GPU UUIDs it is pinned to, comma-separated (what the gate waits for)."""
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
"""Set to "false" on reservation pods: the cluster autoscaler never removes their node (its
notsafetoevict drainability rule blocks, whatever its flags and whatever controller the pod has)."""
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
"""Set to "true" on reservation pods: Karpenter does not consolidate (or drift) their node."""
GATE = f"{api.GROUP}/gpu-reservation"
"""The scheduling gate of a replica pod that waits for its reservations (or its DRA claim)."""
CONTAINER = "reserve"
READY_FILE = "/run/vllmfit/reported"
VOID = "void"
"""NVIDIA_VISIBLE_DEVICES value for "no GPU" (NVIDIA container toolkit): a gated pod's pin
before the reserved GPU is known; the pod is replaced once it is."""


@dataclass(frozen=True)
class Config:
    """How reservation pods are made (operator flags / chart values `reservation.*`)."""

    namespace: str = "default"
    image: str = f"ghcr.io/vllmfit/vllmfit:{__version__}"
    priority_class: str = ""
    runtime_class: str = "nvidia"
    service_account: str = ""
    pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()  # Secrets in `namespace` for `image` (chart value)
    owner_uid: str = ""  # when set, a reservation must carry a controller ownerReference with this uid


@dataclass(frozen=True)
class Reservation:
    """A reservation pod as read from the API."""

    name: str
    node: str
    index: int  # the ledger slot it was asked for
    uuid: str | None = None  # the GPU it reported
    terminating: bool = False

    @property
    def reported(self) -> bool:
        return bool(self.uuid)


class Known(MutableMapping[str, Reservation]):
    """The reservation pods vllmfit knows, by pod name, with what the operator asks of them on
    every event kept as they change: a node's reservations, and the live ones that reported a GPU
    (issue 32: each of those asks went over every reservation of the cluster, so settling grew
    with the square of its size)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Reservation] = {}
        self._by_node: dict[str, dict[str, Reservation]] = {}
        self._reported: dict[str, Reservation] = {}

    def __getitem__(self, name: str) -> Reservation:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __setitem__(self, name: str, r: Reservation) -> None:
        if (old := self._by_name.get(name)) is not None:  # replaced where it was, as a dict does
            self._unindex(name, old)
        self._by_name[name] = r
        self._by_node.setdefault(r.node, {})[name] = r
        if r.reported and not r.terminating:
            self._reported[name] = r

    def __delitem__(self, name: str) -> None:
        self._unindex(name, self._by_name.pop(name))

    def _unindex(self, name: str, r: Reservation) -> None:
        on = self._by_node[r.node]
        del on[name]
        if not on:
            del self._by_node[r.node]
        self._reported.pop(name, None)

    def values(self) -> Any:  # the dict's own view: a pass over all of them at dict speed
        return self._by_name.values()

    def on(self, node: str) -> list[Reservation]:
        """The reservations of `node`."""
        return list(self._by_node.get(node, {}).values())

    def reported_live(self) -> list[Reservation]:
        """The reservations not terminating that reported a GPU, by name."""
        return [self._reported[n] for n in sorted(self._reported)]


def is_reservation(pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(ROLE_LABEL) == ROLE and labels.get(MANAGED_BY) == "vllmfit"


def untrusted(pod: Mapping[str, Any], cfg: Config) -> str | None:
    """Why a pod that carries the reservation labels is not one of vllmfit's reservations (None:
    it is). The trust boundary (issue 21 item 1): tenants may create pods with any labels and
    annotations in their own namespaces, but only the operator (and cluster administrators)
    create pods in the operator's namespace (RBAC). So only pods there count, and only those
    controlled by vllmfit's owner object when one is configured (`owner_uid`); a pod there that
    another controller made (a ReplicaSet, a Job) is not a reservation either."""
    meta = pod.get("metadata") or {}
    ns = str(meta.get("namespace") or "")
    if ns != cfg.namespace:
        return f"it is in namespace {ns[:63]!r}, not in vllmfit's ({cfg.namespace})"
    controllers = [r for r in meta.get("ownerReferences") or [] if isinstance(r, Mapping) and r.get("controller")]
    if cfg.owner_uid:
        if not any(r.get("uid") == cfg.owner_uid for r in controllers):
            return "it is not controlled by vllmfit's owner object"
    elif controllers:
        c = controllers[0]
        return f"it is controlled by {str(c.get('kind'))[:63]} {str(c.get('name'))[:253]}, not by vllmfit"
    return None


def reservation_from_pod(pod: Mapping[str, Any], cfg: Config | None = None) -> Reservation | None:
    """A reservation pod -> Reservation; None for another pod, one without its annotations, or
    (with `cfg`) a lookalike vllmfit did not make (`untrusted`). A pod that ended
    (Succeeded/Failed) holds nothing: it counts as terminating."""
    if not is_reservation(pod) or (cfg is not None and untrusted(pod, cfg) is not None):
        return None
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    try:
        index = int(ann.get(ANNOTATION_INDEX, ""))
    except ValueError:
        return None
    node = str(ann.get(ANNOTATION_NODE) or "")
    if not node:
        return None
    phase = (pod.get("status") or {}).get("phase")
    uuid = str(ann.get(ANNOTATION_UUID) or "").strip() or None
    return Reservation(str(meta.get("name") or ""), node, index, uuid,
                       bool(meta.get("deletionTimestamp")) or phase in ("Succeeded", "Failed"))


def held_uuids(reservations: Iterable[Reservation], node: str) -> set[str]:
    """UUIDs of the GPUs of `node` that live reservations hold."""
    return {r.uuid for r in reservations if r.node == node and r.uuid and not r.terminating}


def slot_of(uuid: str, slots: Mapping[int, str | None]) -> int | None:
    """The ledger index whose GPU has this UUID (slots: index -> UUID when known)."""
    return next((i for i, u in sorted(slots.items()) if u == uuid), None)


def serves(r: Reservation, slots: Mapping[int, str | None]) -> int | None:
    """The slot a reservation holds: the one with its reported UUID; before it reported, or when
    the slot's UUID is unknown (GFD labels only), the one it was asked for."""
    if r.uuid:
        i = slot_of(r.uuid, slots)
        if i is not None:
            return i
        return r.index if slots.get(r.index) is None else None
    return r.index


def mismatch(r: Reservation, slots: Mapping[int, str | None]) -> int | None:
    """When a reservation reported the UUID of another known slot than the one it was asked
    for: that slot (vllmfit re-books there); else None."""
    if not r.uuid or r.terminating:
        return None
    i = slot_of(r.uuid, slots)
    return i if i is not None and i != r.index else None


def learned_uuids(reservations: Iterable[Reservation], node: str, slots: Mapping[int, str | None]) -> dict[int, str]:
    """UUIDs of a node's slots: the known ones, plus those only a reservation reported (a node
    with GFD labels and no agent: the slot a reservation was asked for is the GPU it got)."""
    out = {i: u for i, u in slots.items() if u}
    taken = set(out.values())
    for r in sorted(reservations, key=lambda r: r.name):
        if r.node == node and r.uuid and not r.terminating and slots.get(r.index) is None \
                and r.index not in out and r.uuid not in taken:
            out[r.index] = r.uuid
            taken.add(r.uuid)
    return out


def swap_bookings(bookings: Sequence[Booking], node: str, i: int, j: int) -> list[Booking]:
    """The bookings with GPUs i and j of `node` exchanged (a reservation asked for i got j)."""
    out = []
    for b in bookings:
        if b.node == node and b.index in (i, j):
            b = replace(b, index=j if b.index == i else i)
        out.append(b)
    return out


def swap_placement(placement: Sequence[api.ReplicaPlacement], node: str, i: int, j: int,
                   uuids: Mapping[int, str | None]) -> list[api.ReplicaPlacement]:
    """GPUs i and j of `node` swapped in each replica's placement (its leader's or a worker's pod there)."""

    def swapped(gpus: Sequence[api.GpuRef]) -> list[api.GpuRef]:
        out = []
        for g in gpus:
            k = j if g.index == i else i if g.index == j else g.index
            out.append(g.model_copy(update={"index": k, "uuid": uuids.get(k, g.uuid)}) if k != g.index else g)
        return out

    return [p.model_copy(update={
        "gpus": swapped(p.gpus) if p.node == node else p.gpus,
        "workers": [w.model_copy(update={"gpus": swapped(w.gpus)}) if w.node == node else w for w in p.workers]})
        for p in placement]


@dataclass(frozen=True)
class Plan:
    create: tuple[tuple[str, int], ...]  # (node, index) to reserve
    delete: tuple[str, ...]  # reservation pod names


def plan(wanted: Iterable[tuple[str, int]], reservations: Iterable[Reservation],
         uuids: Mapping[str, Mapping[int, str | None]]) -> Plan:
    """Reservations to create (a wanted slot no live reservation serves) and to delete (one that
    serves no wanted slot, or a second one for the same slot: the reported one is kept)."""
    want = set(wanted)
    live = sorted((r for r in reservations if not r.terminating), key=lambda r: (not r.reported, r.name))
    served: set[tuple[str, int]] = set()
    delete = []
    for r in live:
        i = serves(r, uuids.get(r.node, {}))
        key = (r.node, i) if i is not None else None
        if key is None or key not in want or key in served:
            delete.append(r.name)
        else:
            served.add(key)
    return Plan(tuple(sorted(want - served)), tuple(sorted(delete)))


def pins(node: str, gpus: Sequence[int], uuids: Mapping[int, str]) -> list[str] | None:
    """The UUIDs a replica on `gpus` of `node` is pinned to; None while one is unknown."""
    out = [uuids.get(i) for i in gpus]
    return [u for u in out if u] if all(out) else None


def gate_open(pinned: Sequence[str], held: set[str]) -> bool:
    """A gated replica pod may be scheduled: every GPU it is pinned to is held by a reservation."""
    return bool(pinned) and all(u in held for u in pinned)


def reservation_name(node: str, index: int, taken: Container[str]) -> str:
    """`vllmfit-gpu-<hash of the node>-<index>`, with `-<n>` added if that name is taken (a
    reservation asked for this slot that got another GPU keeps its name). `taken`: looked up, not
    copied (a pass names thousands of reservations against a set of thousands)."""
    base = f"vllmfit-gpu-{hashlib.sha256(node.encode()).hexdigest()[:10]}-{index}"
    if base not in taken:
        return base
    n = 1
    while f"{base}-{n}" in taken:
        n += 1
    return f"{base}-{n}"


def tolerations_for(specs: Iterable[Any]) -> list[dict[str, Any]]:
    """The union of the podTemplate tolerations of the deployments booked on a GPU (their
    VLLMDeploymentSpecs), in a stable order: placement chose the node because each of them
    tolerates its taints, so the reservation that holds the GPU for them must too."""
    seen: dict[str, dict[str, Any]] = {}
    for spec in specs:
        tpl = getattr(spec, "pod_template", None)
        raw = (tpl.spec or {}).get("tolerations") if tpl is not None else None
        for t in raw if isinstance(raw, list) else []:
            if isinstance(t, Mapping):
                seen.setdefault(json.dumps(t, sort_keys=True, default=str), dict(t))
    return [seen[k] for k in sorted(seen)]


def reservation_pod(cfg: Config, node: str, index: int, name: str,
                    tolerations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A pod that holds one GPU of `node` through the device plugin and reports which.

    It is scheduled by the kube-scheduler (node affinity to `node`, not spec.nodeName), so a
    full node shows as `Insufficient nvidia.com/gpu` on it and the cluster autoscaler sees it.
    The container (`vllmfit reserve`) reads NVML, which the NVIDIA runtime limits to the GPU
    the device plugin allocated, patches ANNOTATION_UUID on its own pod and sleeps; it is
    Ready once it has reported. Non-root, no privilege, read-only root file system.

    Disruption (docs/placement-backends.md, "Drain, cluster autoscaler, Karpenter"): it has no
    controller, so `kubectl drain` refuses it unless `--force` (or a `--pod-selector` that leaves
    it out); it tells the cluster autoscaler (SAFE_TO_EVICT "false") and Karpenter
    (DO_NOT_DISRUPT) not to take its node away while it holds a GPU for a vLLM server.
    """
    spec: dict[str, Any] = {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
                        *(dict(t) for t in tolerations)],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 5,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": CONTAINER,
            "image": cfg.image,
            "imagePullPolicy": cfg.pull_policy,
            "args": ["reserve"],
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
            ],
            "resources": {"requests": {GPU_RESOURCE: 1, "cpu": "1m", "memory": "48Mi"},
                          "limits": {GPU_RESOURCE: 1, "memory": "96Mi"}},
            "readinessProbe": {"exec": {"command": ["cat", READY_FILE]}, "periodSeconds": 2},
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "run", "mountPath": "/run/vllmfit"}],
        }],
        "volumes": [{"name": "run", "emptyDir": {"sizeLimit": "1Mi"}}],
    }
    if cfg.priority_class:
        spec["priorityClassName"] = cfg.priority_class
    if cfg.runtime_class:
        spec["runtimeClassName"] = cfg.runtime_class
    if cfg.service_account:
        spec["serviceAccountName"] = cfg.service_account
    if cfg.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in cfg.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": cfg.namespace,
            "labels": {MANAGED_BY: "vllmfit", ROLE_LABEL: ROLE, "app.kubernetes.io/name": "vllmfit-reservation"},
            "annotations": {ANNOTATION_NODE: node, ANNOTATION_INDEX: str(index),
                            SAFE_TO_EVICT: "false", DO_NOT_DISRUPT: "true"},
        },
        "spec": spec,
    }


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message when a pod is Unschedulable (e.g. "0/3 nodes are available: 1
    Insufficient nvidia.com/gpu, ..."), else None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return str(c.get("message") or "Unschedulable")
    return None


def gpu_requests(pod: Mapping[str, Any], resource: str = GPU_RESOURCE) -> int:
    """The pod's effective request of an extended resource, as the scheduler counts it:
    max(sum over containers, max over init containers) (limits stand for absent requests)."""
    spec = pod.get("spec") or {}

    def one(c: Mapping[str, Any]) -> int:
        res = c.get("resources") or {}
        v = (res.get("requests") or {}).get(resource, (res.get("limits") or {}).get(resource, 0))
        try:
            return int(v)
        except (TypeError, ValueError):
            return 0

    main = sum(one(c) for c in spec.get("containers") or [])
    init = max((one(c) for c in spec.get("initContainers") or []), default=0)
    return max(main, init)


def free_for_others(node: Mapping[str, Any], pods: Iterable[Mapping[str, Any]], resource: str = GPU_RESOURCE) -> int:
    """What another pod can still get of `resource` on this node: allocatable minus the requests
    of the non-terminal pods bound to it (the kube-scheduler's NodeResourcesFit arithmetic)."""
    name = (node.get("metadata") or {}).get("name")
    try:
        alloc = int(((node.get("status") or {}).get("allocatable") or {}).get(resource, 0))
    except (TypeError, ValueError):
        alloc = 0
    used = sum(gpu_requests(p, resource) for p in pods
               if (p.get("spec") or {}).get("nodeName") == name
               and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))
    return alloc - used
