"""DRA backend (resource.k8s.io/v1, consumable capacity): pure functions on API objects as JSON.

Where a DRA driver publishes a node's GPUs in ResourceSlices with a `memory` capacity and
`allowMultipleAllocations: true` (NVIDIA's driver with ConsumableShares in `memory` mode; the
dra-example-driver's GPU profile with gpuAllowMultipleAllocations), Kubernetes itself shares a GPU
by memory: each claim asks for `capacity.requests.memory`, and the scheduler allocates a device
only while the sum of the claims' consumed capacity fits. vllmfit then:

- reads the node's GPUs from the slices (`devices_from_slices`: the newest generation of each
  pool, UUID, product, memory) and the memory every allocated claim consumes on them
  (`consumption`), claims vllmfit did not make counting as foreign use (`node_from_dra`);
- gives each replica a ResourceClaimTemplate (`claim_template`) asking, per GPU, for the bytes
  it booked there, pinned to the GPU's UUID by a CEL selector, with a `distinctAttribute`
  constraint on the UUID so that a TP group never lands twice on one GPU;
- reads back what the API server stored (`dropped_fields`): without the DRAConsumableCapacity
  feature gate (alpha, off in 1.34 and 1.35) it silently drops `capacity` and
  `distinctAttribute`, and the claim would ask for whole GPUs;
- reports the scheduler's reason when a replica's pod cannot get its claim (`allocation_failure`).

Device keys are (driver, pool, device); capacity names are normalised (`memory` and
`<driver>/memory` are one capacity: the domain defaults to the device's driver).

Issue 21 (items 5, 6): a claim asks for every capacity the device publishes (a capacity left out
is consumed at its default, the whole device for dra-example-driver's `compute`, so a second
claim would not fit): `memory` as booked, every other one at the least its request policy
allows, each rounded the way the scheduler rounds it; only whole GPUs are GPUs (MIG and other
partitions are not counted as GPUs; what a claim takes through a partition is foreign use of its
parent, found by parentUUID or a shared counter set); every number read from a slice or a claim
is bounded (vllmfit.core.limits); a catalog entry never replaces the memory a slice reports.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any

from vllmfit.core import limits
from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement import GpuSlot, NodeInfo
from vllmfit.core.placement.inputs import GpuLookup
from vllmfit.core.spec import api

API_VERSION = "resource.k8s.io/v1"
NVIDIA_DRIVER = "gpu.nvidia.com"
MEMORY = "memory"
CLAIM_NAME = "gpus"  # pod.spec.resourceClaims[].name of a replica
MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = f"{api.GROUP}/deployment"
LABEL_REPLICA = f"{api.GROUP}/replica"
UUID_ATTRIBUTE = "uuid"
PRODUCT_ATTRIBUTES = ("productName", "model")  # NVIDIA driver; dra-example-driver
QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
SUFFIX = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
          "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity_bytes(q: Any) -> int:
    """A Kubernetes Quantity ("81559Mi", "18Gi", "1e9", 1024) as whole bytes, rounded up.
    Raises ValueError on anything else."""
    m = QUANTITY.match(str(q).strip())
    if not m:
        raise ValueError(f"not a quantity: {q!r}")
    try:
        value = Decimal(m.group(1)) * Decimal(SUFFIX[m.group(2)])
    except InvalidOperation:
        raise ValueError(f"not a quantity: {q!r}") from None
    return math.ceil(value)


def quantity(n: int) -> str:
    """Bytes as the canonical Quantity the API server would store: the largest binary suffix that
    divides it exactly, else plain bytes."""
    for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def _attr(attrs: Mapping[str, Any], name: str, driver: str) -> Any:
    """An attribute by its bare name or `<driver>/<name>` (the domain defaults to the driver)."""
    raw = attrs.get(name, attrs.get(f"{driver}/{name}"))
    if not isinstance(raw, Mapping):
        return None
    for kind in ("string", "int", "bool", "version"):
        if kind in raw:
            return raw[kind]
    return None


def capacity_name(name: str, driver: str) -> str:
    """`memory` for both `memory` and `<driver>/memory`."""
    return name.removeprefix(f"{driver}/")


# --- ResourceSlices -> devices -----------------------------------------------------------------

MAX_CAPACITIES = 32  # per device (the API allows 32 attributes + capacities)
MAX_CAPACITY_VALUE = 1 << 62
MAX_VALID_VALUES = 64
WHOLE_GPU_TYPES = (None, "gpu")  # NVIDIA's driver: attribute `type` is gpu, mig or vfio


@dataclass(frozen=True)
class Policy:
    """A capacity's requestPolicy (KEP-5075): a default, and valid values or a valid range."""

    default: int | None = None
    values: tuple[int, ...] = ()
    min: int | None = None
    max: int | None = None
    step: int | None = None

    def rounded(self, want: int) -> int | None:
        """What the scheduler consumes for a request of `want` (rounded up to a valid value or
        the range's step); None when no value can hold it."""
        if self.values:
            return next((v for v in self.values if v >= want), None)
        if self.min is not None:
            got = max(want, self.min)
            if self.step:
                got = self.min + -(-(got - self.min) // self.step) * self.step
            return None if self.max is not None and got > self.max else got
        return want

    def text(self) -> str:
        """The policy in the API's words (for a refusal)."""
        if self.values:
            return "validValues [" + ", ".join(quantity(v) for v in self.values) + "]"
        if self.min is not None:
            parts = [f"min {quantity(self.min)}"] + ([f"max {quantity(self.max)}"] if self.max is not None else []) \
                + ([f"step {quantity(self.step)}"] if self.step else [])
            return "validRange " + ", ".join(parts)
        return "no valid values or range"

    def least(self) -> int:
        """The least a request may ask for."""
        if self.values:
            return self.values[0]
        return self.min if self.min is not None and self.min > 0 else 1


@dataclass(frozen=True)
class Capacity:
    name: str
    value: int
    policy: Policy | None = None

    def request(self, want: int) -> int | None:
        """The amount to request for `want` (rounded as the scheduler would); None if impossible."""
        got = self.policy.rounded(want) if self.policy else want
        return None if got is None or got > self.value else got


def _bounded(q: Any) -> int:
    n = quantity_bytes(q)
    if not 0 <= n <= MAX_CAPACITY_VALUE:
        raise ValueError(f"quantity out of range: {q!r}")
    return n


def _policy(raw: Any) -> Policy | None:
    if not isinstance(raw, Mapping):
        return None
    default = _bounded(raw["default"]) if raw.get("default") is not None else None
    values = raw.get("validValues")
    if isinstance(values, list) and values:
        return Policy(default, tuple(sorted({_bounded(v) for v in values[:MAX_VALID_VALUES]})))
    rng = raw.get("validRange")
    if isinstance(rng, Mapping) and rng.get("min") is not None:
        step = _bounded(rng["step"]) if rng.get("step") is not None else None
        return Policy(default, (), _bounded(rng["min"]), _bounded(rng["max"]) if rng.get("max") is not None else None,
                      step or None)
    return Policy(default)


def _capacities(raw: Any, driver: str) -> tuple[Capacity, ...] | None:
    """A device's capacities, bounded; None when there are too many or one is unreadable."""
    if not isinstance(raw, Mapping) or len(raw) > MAX_CAPACITIES:
        return None
    out = []
    try:
        for k, v in raw.items():
            if not isinstance(v, Mapping):
                return None
            out.append(Capacity(capacity_name(str(k), driver), _bounded(v.get("value")), _policy(v.get("requestPolicy"))))
    except (ValueError, TypeError, KeyError):
        return None
    return tuple(sorted(out, key=lambda c: c.name))


@dataclass(frozen=True)
class Device:
    """One device a ResourceSlice publishes on a node."""

    driver: str
    pool: str
    name: str
    node: str
    uuid: str | None
    product: str
    memory_bytes: int
    shareable: bool  # allowMultipleAllocations and a memory capacity
    index: int | None = None  # the driver's `index` attribute, when it has one
    capacities: tuple[Capacity, ...] = ()  # every capacity it publishes (memory among them)
    partitions: tuple[tuple[tuple[str, str, str], int], ...] = ()  # (MIG device key, its memory) on this GPU

    def capacity(self, name: str) -> Capacity | None:
        return next((c for c in self.capacities if c.name == name), None)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)


def _number(name: str) -> tuple[int, str]:
    digits = re.findall(r"\d+", name)
    return (int(digits[-1]) if digits else 1 << 30, name)


def devices_from_slices(slices: Iterable[Mapping[str, Any]], drivers: Sequence[str] = (NVIDIA_DRIVER,)
                        ) -> dict[str, list[Device]]:
    """node -> the GPUs the slices of `drivers` publish there, sorted by their `index` attribute
    or the number in their name. Only the newest generation of each pool counts; a pool whose
    slices are not all there yet (resourceSliceCount) is skipped; devices without a memory
    capacity are not GPUs vllmfit can size."""
    newest: dict[tuple[str, str], int] = {}
    slices = [s for s in slices if ((s.get("spec") or {}).get("driver")) in drivers]
    for s in slices:
        spec = s.get("spec") or {}
        pool = spec.get("pool") or {}
        key = (spec.get("driver"), pool.get("name"))
        newest[key] = max(newest.get(key, 0), int(pool.get("generation") or 0))  # type: ignore[index]
    current = [s for s in slices if int(((s.get("spec") or {}).get("pool") or {}).get("generation") or 0)
               == newest[((s.get("spec") or {}).get("driver"), ((s.get("spec") or {}).get("pool") or {}).get("name"))]]
    counts: dict[tuple[str, str], int] = {}
    for s in current:
        spec = s.get("spec") or {}
        key = (spec.get("driver"), (spec.get("pool") or {}).get("name"))
        counts[key] = counts.get(key, 0) + 1  # type: ignore[index]
    out: dict[str, list[Device]] = {}
    parts: dict[str, list[tuple[tuple[str, str, str], str | None, frozenset[str], int]]] = {}
    for s in current:
        spec = s.get("spec") or {}
        pool = spec.get("pool") or {}
        driver, node = str(spec.get("driver")), spec.get("nodeName")
        if not node or counts[(driver, pool.get("name"))] < int(pool.get("resourceSliceCount") or 1):
            continue
        for d in (spec.get("devices") or [])[:limits.MAX_GPUS_PER_NODE * (1 + limits.MAX_MIG_PER_GPU)]:
            if not isinstance(d, Mapping):
                continue
            attrs = d.get("attributes") or {}
            caps = _capacities(d.get("capacity") or {}, driver)
            mem_cap = next((c for c in caps or () if c.name == MEMORY), None)
            if mem_cap is None or not limits.MIN_GPU_MEMORY_BYTES // 1024 <= mem_cap.value <= limits.MAX_GPU_MEMORY_BYTES:
                continue  # not a GPU vllmfit can size, or a number no GPU has
            dkey: tuple[str, str, str] = (driver, str(pool.get("name")), str(d.get("name")))
            counters = frozenset(str(c.get("counterSet")) for c in d.get("consumesCounters") or []
                                 if isinstance(c, Mapping) and c.get("counterSet"))
            kind = _attr(attrs, "type", driver)
            parent = _attr(attrs, "parentUUID", driver)
            if kind not in WHOLE_GPU_TYPES or parent is not None:
                parts.setdefault(str(node), []).append((dkey, str(parent) if parent else None, counters, mem_cap.value))
                continue  # a MIG device or another partition: not a whole GPU
            if mem_cap.value < limits.MIN_GPU_MEMORY_BYTES:
                continue
            product = next((str(v) for a in PRODUCT_ATTRIBUTES if (v := _attr(attrs, a, driver)) is not None), "")
            index = _attr(attrs, "index", driver)
            uuid = _attr(attrs, UUID_ATTRIBUTE, driver)
            out.setdefault(str(node), []).append(Device(
                driver, dkey[1], dkey[2], str(node), str(uuid)[:128] if uuid is not None else None,
                "-".join(product.split())[:128], mem_cap.value, bool(d.get("allowMultipleAllocations")),
                index if isinstance(index, int) and 0 <= index < limits.MAX_GPUS_PER_NODE else None,
                caps or (), _counters_marker(counters)))
    for node, devs in list(out.items()):
        if len(devs) > limits.MAX_GPUS_PER_NODE:
            del out[node]  # more GPUs than a node has: not believed
            continue
        devs.sort(key=lambda d: (d.index if d.index is not None else _number(d.name)[0], d.name))
        out[node] = [_with_partitions(d, parts.get(node, [])) for d in devs]
    return out


def _counters_marker(counters: frozenset[str]) -> tuple[tuple[tuple[str, str, str], int], ...]:
    """The counter sets a whole GPU consumes, kept until its partitions are attached."""
    return tuple((("", "counter", c), -1) for c in sorted(counters))


def _with_partitions(d: Device, parts: Sequence[tuple[tuple[str, str, str], str | None, frozenset[str], int]]
                     ) -> Device:
    """The device with the partitions (MIG devices) carved from it: those naming its UUID as
    parentUUID, or consuming a counter set it consumes too (partitionable devices, KEP-4815)."""
    counters = {k[2] for k, n in d.partitions if n == -1}
    mine = tuple((key, mem) for key, parent, used, mem in parts
                 if (parent is not None and parent == d.uuid) or (parent is None and counters & used))
    return replace(d, partitions=mine)


def shareable(devices: Sequence[Device]) -> bool:
    """A node DRA can share by memory: it publishes GPUs, every one with a memory capacity and
    allowMultipleAllocations (the API server drops that field when DRAConsumableCapacity is off)."""
    return bool(devices) and all(d.shareable for d in devices)


def backend_for(mode: str, devices: Sequence[Device]) -> str:
    """"dra" or "device-plugin" for a node, under the operator's --placement-backend."""
    if mode == "dra":
        return "dra"
    if mode == "device-plugin":
        return "device-plugin"
    return "dra" if shareable(devices) else "device-plugin"


# --- ResourceClaims -> what is consumed --------------------------------------------------------


@dataclass(frozen=True)
class Use:
    """Memory one allocated claim consumes on one device."""

    claim: str  # namespace/name
    device: tuple[str, str, str]
    bytes: int
    deployment: str | None  # namespace/name of the VLLMDeployment when vllmfit made it
    replica: int | None = None


def claim_owner(claim: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """(namespace/deployment, replica) for a claim vllmfit's template generated, else (None, None)."""
    meta = claim.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(MANAGED_BY) != "vllmfit" or not labels.get(LABEL_DEPLOYMENT):
        return None, None
    try:
        replica = int(labels.get(LABEL_REPLICA, ""))
    except ValueError:
        replica = None
    return f"{meta.get('namespace') or 'default'}/{labels[LABEL_DEPLOYMENT]}", replica


def consumption(claims: Iterable[Mapping[str, Any]], devices: Mapping[tuple[str, str, str], Device]) -> list[Use]:
    """What every allocated claim consumes on the known devices: its `consumedCapacity` memory
    (rounded up by the device's request policy: what the scheduler counts), or the whole device
    when the result has none (a device that is not shared: the claim holds all of it)."""
    out = []
    parts = {pk: (d, mem) for d in devices.values() for pk, mem in d.partitions if mem >= 0}
    for c in claims:
        meta = c.get("metadata") or {}
        name = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        owner, replica = claim_owner(c)
        results = ((((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or [])
        for r in results[:limits.MAX_GPUS_PER_NODE * 8] if isinstance(results, list) else []:
            if not isinstance(r, Mapping):
                continue
            key = (str(r.get("driver")), str(r.get("pool")), str(r.get("device")))
            dev = devices.get(key)
            if dev is None:
                if key in parts:  # a MIG device of a GPU vllmfit shares: its memory is taken there
                    parent, mem = parts[key]
                    out.append(Use(name, parent.key, min(mem, parent.memory_bytes), None, None))
                continue
            raw = r.get("consumedCapacity")
            consumed = {capacity_name(str(k), dev.driver): v for k, v in raw.items()} if isinstance(raw, Mapping) else {}
            try:
                used = quantity_bytes(consumed[MEMORY]) if MEMORY in consumed else dev.memory_bytes
            except ValueError:
                used = dev.memory_bytes
            out.append(Use(name, key, min(max(used, 0), dev.memory_bytes), owner, replica))  # bounded by the device
    return out


def device_indices(devices: Sequence[Device], agent: NodeInfo | None = None) -> dict[tuple[str, str, str], int]:
    """The ledger index of each device: the agent's index for the same UUID when the agent runs
    on the node, else the position in `devices` (sorted by index attribute or name)."""
    by_uuid = {s.uuid: s.index for s in (agent.gpus if agent else ()) if s.uuid}
    return {d.key: by_uuid.get(d.uuid, pos) if d.uuid else pos for pos, d in enumerate(devices)}


def node_from_dra(node: str, labels: Mapping[str, str], devices: Sequence[Device], uses: Iterable[Use],
                  gpu_lookup: GpuLookup, *, booked: Mapping[tuple[str, int], int] | None = None,
                  agent: NodeInfo | None = None, facts: NodeInfo | None = None) -> NodeInfo:
    """A DRA node's GPUs as the ledger sees them (indices: `device_indices`). Foreign use of a
    GPU: the memory claims vllmfit did not make consume, plus what vllmfit's own claims consume
    beyond what it booked (`booked`: (node, index) -> bytes; the scheduler rounds requests up to
    the device's step); at least the agent's measured foreign use (the processes of foreign
    claims are the same memory, so the two are not added)."""
    known = {s.uuid: s for s in (agent.gpus if agent else ()) if s.uuid}
    index = device_indices(devices, agent)
    used: dict[tuple[str, str, str], tuple[int, int]] = {}  # device -> (foreign, vllmfit's)
    for u in uses:
        f, m = used.get(u.device, (0, 0))
        used[u.device] = (f, m + u.bytes) if u.deployment else (f + u.bytes, m)
    slots = []
    for d in devices:
        k = known.get(d.uuid) if d.uuid else None
        i = index[d.key]
        gpu: GpuType = k.gpu if k else reported(gpu_lookup(d.product or "unknown", d.memory_bytes // (1 << 20)),
                                                 d.memory_bytes)
        foreign, mine = used.get(d.key, (0, 0))
        excess = max(0, mine - (booked or {}).get((node, i), 0))
        slots.append(GpuSlot(node, i, gpu, d.uuid, max(foreign + excess, k.foreign_bytes if k else 0)))
    # `facts`: what the Node object says; its taints and cordon hold on a DRA node too (issue 21)
    return NodeInfo(node, dict(labels), tuple(sorted(slots, key=lambda s: s.index)), agent.warnings if agent else (),
                    taints=facts.taints if facts else (), unschedulable=facts.unschedulable if facts else False)


def reported(gpu: GpuType, memory_bytes: int) -> GpuType:
    """The catalog's facts for a product with the memory the slice reports: a catalog entry never
    replaces a capacity the cluster reports (a smaller partition, another memory size of the same
    name). What CUDA cannot use (total minus cudaMemGetInfo's total) stays the catalog's."""
    if gpu.memory_bytes == memory_bytes:
        return gpu
    hidden = max(0, gpu.memory_bytes - gpu.cuda_total_bytes)
    return replace(gpu, memory_bytes=memory_bytes, cuda_total_bytes=max(0, memory_bytes - hidden),
                   source=f"{gpu.source}; memory from the ResourceSlice")


def foreign_claims(node: str, devices: Sequence[Device], uses: Iterable[Use], agent: NodeInfo | None = None
                   ) -> list[tuple[int, str, int]]:
    """(GPU index, claim, bytes) for every claim vllmfit did not make on the node's devices."""
    index = device_indices(devices, agent)
    return sorted((index[u.device], u.claim, u.bytes) for u in uses if u.deployment is None and u.device in index)


# --- What vllmfit writes -----------------------------------------------------------------------


def template_name(deployment: str, replica: int) -> str:
    return f"{deployment}-{replica}"


class Unsatisfiable(ValueError):
    """A device's request policy cannot grant what a replica booked there (one line)."""


def capacity_requests(device: Device | None, need: int) -> dict[str, str]:
    """Every capacity `device` publishes, as a claim request: memory for `need` bytes, every other
    capacity at the least its policy allows (a capacity left out is consumed at its default, the
    whole device when it has none), each rounded up as the scheduler rounds it. Without the
    device's capacities (not read yet): memory alone. Raises Unsatisfiable."""
    if device is None or not device.capacities:
        return {MEMORY: quantity(need)}
    out = {}
    for c in device.capacities:
        want = need if c.name == MEMORY else (c.policy.least() if c.policy else 1)
        got = c.request(want)
        if got is None:
            raise Unsatisfiable(f"{device.node} {device.name}: the request policy of its {c.name!r} capacity cannot "
                                f"grant {quantity(want)} (of {quantity(c.value)}; requestPolicy "
                                f"{c.policy.text() if c.policy else 'none'})")
        # memory: exactly what was booked (the scheduler rounds it up; the rest is counted as the
        # driver's rounding, node_from_dra); the others: the least the policy allows
        out[c.name] = quantity(want if c.name == MEMORY else got)
    return out


def claim_template(name: str, namespace: str, deployment: str, replica: int,
                   gpus: Sequence[tuple[str, int]], *, device_class: str, driver: str = NVIDIA_DRIVER,
                   devices: Sequence[Device | None] | None = None) -> dict[str, Any]:
    """The ResourceClaimTemplate of one replica: per GPU (UUID, bytes booked there) one request
    `gpu<i>` for exactly that device, asking for that much memory and every other capacity the
    device (`devices[i]`) publishes (`capacity_requests`); a distinctAttribute constraint on the
    UUID across the requests of a TP group. Its claims carry vllmfit's labels (foreign use is
    every claim without them). Raises Unsatisfiable."""
    labels = {MANAGED_BY: "vllmfit", LABEL_DEPLOYMENT: deployment, LABEL_REPLICA: str(replica)}
    requests = []
    for i, (uuid, need) in enumerate(gpus):
        caps = capacity_requests(devices[i] if devices is not None and i < len(devices) else None, need)
        requests.append({"name": f"gpu{i}", "exactly": {
            "deviceClassName": device_class,
            "allocationMode": "ExactCount",
            "count": 1,
            "selectors": [{"cel": {"expression": f'device.attributes["{driver}"].{UUID_ATTRIBUTE} == "{uuid}"'}}],
            "capacity": {"requests": caps},
        }})
    wanted: dict[str, Any] = {"requests": requests}
    if len(requests) > 1:
        wanted["constraints"] = [{"requests": [r["name"] for r in requests],
                                  "distinctAttribute": f"{driver}/{UUID_ATTRIBUTE}"}]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {"metadata": {"labels": dict(labels)}, "spec": {"devices": wanted}},
    }


def fingerprint(template: Mapping[str, Any]) -> str:
    """A short digest of a template's claim spec (templates are immutable: a changed one is
    deleted and made again under the same name)."""
    import json

    raw = json.dumps((template.get("spec") or {}).get("spec"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def dropped_fields(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> list[str]:
    """Fields of a ResourceClaimTemplate the API server did not keep (DRAConsumableCapacity off:
    it drops `capacity` and `distinctAttribute` without an error)."""
    out = []
    want = (((sent.get("spec") or {}).get("spec") or {}).get("devices") or {})
    got = (((stored.get("spec") or {}).get("spec") or {}).get("devices") or {})
    got_reqs = {r.get("name"): r for r in got.get("requests") or []}
    for r in want.get("requests") or []:
        g = got_reqs.get(r["name"]) or {}
        w_cap = (((r.get("exactly") or {}).get("capacity") or {}).get("requests") or {})
        g_cap = (((g.get("exactly") or {}).get("capacity") or {}).get("requests") or {})
        for k, v in w_cap.items():
            try:
                same = k in g_cap and quantity_bytes(g_cap[k]) == quantity_bytes(v)
            except ValueError:
                same = False
            if not same:
                out.append(f"requests[{r['name']}].exactly.capacity.requests.{k}")
    for i, c in enumerate(want.get("constraints") or []):
        if c.get("distinctAttribute") and not any(
                g.get("distinctAttribute") == c["distinctAttribute"] for g in got.get("constraints") or []):
            out.append(f"constraints[{i}].distinctAttribute")
    return out


def pod_binding(template: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec fields, vllm container resources fields) that give the container its claim."""
    return ({"resourceClaims": [{"name": CLAIM_NAME, "resourceClaimTemplateName": template}]},
            {"claims": [{"name": CLAIM_NAME}]})


# --- The scheduler's answer --------------------------------------------------------------------

ALLOCATION_REASONS = ("cannot allocate all claims", "timed out trying to allocate devices",
                      "resourceclaim not available on the node", "resourceclaim in use", "does not exist")


def allocation_failure(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message when a pod with claims is Unschedulable for a DRA reason
    (`PodScheduled=False`, reason `Unschedulable`, e.g. "0/3 nodes are available: 1 cannot
    allocate all claims, ..."), else None. A gated pod is not failing."""
    if not (pod.get("spec") or {}).get("resourceClaims"):
        return None
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            message = str(c.get("message") or "")
            if any(r in message.lower() for r in ALLOCATION_REASONS):
                return message
    return None
