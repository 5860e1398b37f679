"""Reading a node's GPUs from cluster objects: GPU Feature Discovery labels and the node agent's
inventory annotation (MIG slices and foreign use included).

Node data is read defensively (`read_node`): it comes from labels and an annotation that other
programs write, and a wrong value must never evict a node or invent memory.

- The inventory schema is forward-compatible: unknown fields are ignored, a newer schemaVersion is
  read by the fields this version knows (with a warning).
- Every count, index and byte value is checked against vllmfit.core.limits; the memory the agent
  reports for a GPU may not exceed what the catalog or the node's GFD memory label says for its
  product by more than GPU_MEMORY_TOLERANCE, and it may not report more GPUs than GFD counted.
- An inventory older than INVENTORY_STALE_SECONDS is ignored with a warning: GFD's labels are
  used instead (a date in the future is taken as clock skew, i.e. fresh).
- Taints and `spec.unschedulable` are carried on the node (core.placement.taints): placement
  gives a cordoned or untolerably tainted node no new booking.
- Anything malformed is a `problem`. The caller keeps the node's last good state (`previous`)
  and reports the problem (the operator: a condition, an Event and a metric); without a previous
  state, GFD's labels are used when they are readable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from vllmfit.core import defaults, limits
from vllmfit.core.errors import one_line
from vllmfit.core.memory import DEFAULT_POLICY, BudgetPolicy
from vllmfit.core.model.facts import GpuType
from vllmfit.core.observe import attribution
from vllmfit.core.observe.inventory import INVENTORY_SCHEMA_VERSION, GpuInventory
from vllmfit.core.placement.inputs import GpuLookup, GpuSlot, NodeInfo
from vllmfit.core.placement.taints import read_taints
from vllmfit.core.quantity import parse_bytes


def mig_gpu_type(parent: GpuType, profile: str, total_bytes: int) -> GpuType:
    """A MIG slice as a GPU type: vLLM's T is the slice's memory (NVML total of the MIG device)."""
    product = f"{parent.product}-MIG-{profile}" if profile else f"{parent.product}-MIG"
    return GpuType(
        product=product,
        name=f"{parent.name} MIG {profile}".strip(),
        memory_bytes=total_bytes,
        cuda_total_bytes=total_bytes,
        architecture=parent.architecture,
        source="MIG device (agent)",
        compute_capability=parent.compute_capability,
    )


class NodeDataError(ValueError, LookupError):
    """A node's GPU labels or inventory annotation cannot be trusted (message: one line; a ValueError
    for callers that treat it as unreadable input, a LookupError for those that look GPUs up). The
    node keeps its last good state; it is never evicted for it."""


@dataclass(frozen=True)
class NodeRead:
    """What a v1/Node says about its GPUs."""

    name: str
    info: NodeInfo | None  # its GPUs; None: no usable GPU information (a CPU-only node, or a problem)
    problem: str | None = None  # why its node data was refused (one line); None when it was read
    warnings: tuple[str, ...] = ()

    @property
    def has_gpu_data(self) -> bool:
        """Whether the node says anything about GPUs (a CPU-only node does not)."""
        return self.info is not None or self.problem is not None


NOTHING = BudgetPolicy(0.0, 0, "invalid node label", context_bytes=0)
"""The policy of a node whose budget labels are invalid: it hands out nothing."""


def node_policy(
    labels: Mapping[str, str], cluster: BudgetPolicy = DEFAULT_POLICY
) -> tuple[BudgetPolicy, str | None]:
    """The budget policy of a node: its node-pool labels (vllmfit.dev/budget-utilization,
    vllmfit.dev/budget-reserve, e.g. "0.95" and "1Gi") over the cluster-wide one. Returns
    (policy, error); with an error the node takes nothing (budget 0) and says why."""
    u_text = labels.get(defaults.BUDGET_UTILIZATION_LABEL)
    r_text = labels.get(defaults.BUDGET_RESERVE_LABEL)
    if u_text is None and r_text is None:
        return cluster, None
    u, reserve = cluster.utilization, cluster.reserve_bytes
    try:
        if u_text is not None:
            u = float(u_text)  # NaN and inf fail policy.error() below
        if r_text is not None:
            reserve = parse_bytes(r_text, f"label {defaults.BUDGET_RESERVE_LABEL}")
    except ValueError as e:
        msg = str(e) if r_text is not None and "label" in str(e) else (
            f"label {defaults.BUDGET_UTILIZATION_LABEL}={u_text!r} is not a number in [0, 1]")
        return NOTHING, msg
    policy = cluster.with_utilization(u, reserve, "node pool label")
    bad = policy.error()
    if bad:
        return NOTHING, bad.replace(
            "(node pool label)", f"(node label {defaults.BUDGET_UTILIZATION_LABEL if 'utilization' in bad else defaults.BUDGET_RESERVE_LABEL})")
    return policy, None


def _with_policy(node: NodeInfo, cluster: BudgetPolicy) -> NodeInfo:
    policy, error = node_policy(node.labels, cluster)
    if error is None:
        for sl in node.gpus:
            bad = policy.error(sl.capacity_bytes)
            if bad:
                policy, error = NOTHING, f"{sl.label}: {bad}"
                break
    if policy == DEFAULT_POLICY and error is None:
        return node
    slots = tuple(replace(sl, policy=policy) for sl in node.gpus)
    return replace(node, gpus=slots, error=None if error is None else f"budget policy: {error}")


def read_node(
    obj: Mapping[str, Any],
    gpu_lookup: GpuLookup,
    pods: Mapping[str, str] | None = None,
    *,
    now: datetime | None = None,
    previous: NodeInfo | None = None,
    policy: BudgetPolicy = DEFAULT_POLICY,
) -> NodeRead:
    """`_read_node`, with the node's budget policy on its GPUs (`node_policy`: node-pool labels over
    `policy`, the cluster-wide one)."""
    r = _read_node(obj, gpu_lookup, pods, now=now, previous=previous)
    if r.info is None:
        return r
    node_spec = obj.get("spec") if isinstance(obj, Mapping) else None
    taints, unschedulable, problem = read_taints(node_spec)
    info = _with_policy(r.info, policy)
    unsafe = binding_problem(info.labels)
    if (info.taints, info.unschedulable, info.unsafe) != (taints, unschedulable, unsafe):
        info = replace(info, taints=taints, unschedulable=unschedulable, unsafe=unsafe)
    warnings = (*r.warnings, f"node {r.name}: {problem}") if problem else r.warnings
    return replace(r, info=info, warnings=warnings)


def _read_node(
    obj: Mapping[str, Any],
    gpu_lookup: GpuLookup,
    pods: Mapping[str, str] | None = None,
    *,
    now: datetime | None = None,
    previous: NodeInfo | None = None,
) -> NodeRead:
    """A v1/Node -> its GPUs, never raising. The agent's inventory annotation wins over GFD labels.

    `gpu_lookup(product, memory_mib)` resolves a product name to catalog facts (the caller passes
    vllmfit.sources.catalog.gpu_for_label); it raises LookupError for an unknown product without memory.
    `pods` maps the UIDs of vllmfit's pods to their deployment: their memory is booked in the
    ledger, everything else in use is foreign (vllmfit.core.observe.attribution's rule; without `pods`, all
    memory in use is foreign). A MIG-enabled GPU is replaced by its slices (unit index
    1000 x (gpu + 1) + slice). `now` turns on the staleness check (the operator passes the clock;
    `vllmfit plan` reads an export of unknown age and passes None). `previous` is the node's last
    good state: on a problem it is kept, with the problem reported.
    """
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    meta = meta if isinstance(meta, Mapping) else {}
    name = " ".join(str(meta.get("name") or "").split())[:253]  # one line in every message
    raw_labels = meta.get("labels")
    labels = {str(k): str(v) for k, v in raw_labels.items()} if isinstance(raw_labels, Mapping) else {}
    raw_ann = meta.get("annotations")
    annotations = raw_ann if isinstance(raw_ann, Mapping) else {}
    warnings: list[str] = []
    raw = annotations.get(defaults.INVENTORY_ANNOTATION)
    problem = None
    if raw:
        try:
            inv = _inventory(name, raw, labels, gpu_lookup, now, warnings)
            if inv is not None:
                info = NodeInfo(name, labels, _slots_from_inventory(name, inv, gpu_lookup, pods or {}, warnings),
                                tuple(warnings))
                return NodeRead(name, info, None, tuple(warnings))
        except NodeDataError as e:
            problem = str(e)
        except LookupError as e:
            problem = f"node {name}: {one_line(e)}"
    product = labels.get(defaults.GFD_PRODUCT_LABEL)
    count = labels.get(defaults.GFD_COUNT_LABEL)
    if not product and not count and problem is None:
        return NodeRead(name, None, None, tuple(warnings))  # a CPU-only node
    try:
        if not product or not count:
            raise NodeDataError(
                f"node {name} has no GPU information: needs the {defaults.GFD_PRODUCT_LABEL} and "
                f"{defaults.GFD_COUNT_LABEL} labels (GPU Feature Discovery) or the "
                f"{defaults.INVENTORY_ANNOTATION} annotation (vllmfit agent)"
            )
        n = _label_int(name, labels, defaults.GFD_COUNT_LABEL, limits.MAX_GPUS_PER_NODE)
        mem = _label_int(name, labels, defaults.GFD_MEMORY_LABEL, limits.MAX_GPU_MEMORY_BYTES // defaults.MIB,
                         limits.MIN_GPU_MEMORY_BYTES // defaults.MIB)
        facts = gpu_lookup(product, mem)
        fallback = NodeInfo(name, labels, tuple(GpuSlot(name, i, facts) for i in range(n)), tuple(warnings))
    except (NodeDataError, LookupError, ValueError) as e:
        fallback = None
        problem = problem or (str(e) if isinstance(e, NodeDataError) else f"node {name}: {one_line(e)}")
    if problem is None:
        return NodeRead(name, fallback, None, tuple(warnings))
    kept = previous if previous is not None else fallback
    return NodeRead(name, kept, problem, tuple(warnings))


BINDING_LABEL = "vllmfit.dev/binding"
"""A node-pool label the cluster administrator sets to override what vllmfit reads from the node:
`visible-devices` (the NVIDIA container runtime honours NVIDIA_VISIBLE_DEVICES here: share its
GPUs through reservation pods) or `none` (place nothing here)."""
SHARING_LABEL = "nvidia.com/gpu.sharing-strategy"  # GPU Feature Discovery: none, time-slicing, mps
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
GPU_OPERATOR_LABEL = "nvidia.com/gpu.deploy.container-toolkit"  # the GPU Operator's NVIDIA runtime runs here


def binding_problem(labels: Mapping[str, str]) -> str | None:
    """Why no GPU binding of vllmfit's device-plugin backend can hold this node's GPUs (None: one
    can), in the kube-scheduler's way of counting nodes (issue 21 item 5):

    - time-slicing or MPS in the device plugin (`nvidia.com/gpu.replicas` > 1, or the sharing
      strategy label): one `nvidia.com/gpu` is a fraction of a GPU, so neither a reservation pod
      nor a replica's limit holds a whole GPU;
    - GKE's own GPU driver (the `cloud.google.com/gke-accelerator` label without the GPU
      Operator's container toolkit): its device plugin exposes only the GPUs a container
      requests, so NVIDIA_VISIBLE_DEVICES cannot give a replica the GPU its reservation holds.

    The label `vllmfit.dev/binding` overrides: `visible-devices` (the administrator vouches for
    the NVIDIA runtime there) or `none`. A node whose GPUs DRA shares is read from its
    ResourceSlices instead and is not concerned."""
    override = labels.get(BINDING_LABEL, "").strip()
    if override == "visible-devices":
        return None
    if override == "none":
        return f"node(s) had label {BINDING_LABEL}=none"
    replicas = labels.get(REPLICAS_LABEL, "").strip()
    strategy = labels.get(SHARING_LABEL, "").strip()
    if (replicas.isdigit() and int(replicas) > 1) or strategy in ("time-slicing", "mps"):
        how = strategy if strategy in ("time-slicing", "mps") else "time-slicing or MPS"
        return (f"node(s) shared each GPU through the device plugin ({how}, {REPLICAS_LABEL}={replicas or '?'}): "
                "a reservation cannot hold a whole GPU there; use DRA or turn sharing off on that node pool")
    if labels.get(GKE_ACCELERATOR_LABEL) and labels.get(GPU_OPERATOR_LABEL) != "true":
        return (f"node(s) ran GKE's GPU driver, which exposes only requested GPUs (NVIDIA_VISIBLE_DEVICES cannot "
                f"pin a shared GPU); use DRA, the GPU Operator, or label the pool {BINDING_LABEL}=visible-devices")
    return None


def node_from_object(
    obj: Mapping[str, Any], gpu_lookup: GpuLookup, pods: Mapping[str, str] | None = None,
    policy: BudgetPolicy = DEFAULT_POLICY, *, now: datetime | None = None,
) -> NodeInfo:
    """`read_node` for callers that want an exception: raises ValueError when the node has no GPU
    information at all, NodeDataError (a LookupError) when its node data is refused and no GFD
    labels stand in. A refused inventory with readable labels gives the labels' GPUs, the
    problem among the node's warnings. `now`: ignore an inventory older than the staleness limit."""
    r = read_node(obj, gpu_lookup, pods, policy=policy, now=now)
    if r.info is None:
        if r.problem is None:
            raise ValueError(
                f"node {r.name} has no GPU information: needs the {defaults.GFD_PRODUCT_LABEL} and "
                f"{defaults.GFD_COUNT_LABEL} labels (GPU Feature Discovery) or the "
                f"{defaults.INVENTORY_ANNOTATION} annotation (vllmfit agent)"
            )
        raise NodeDataError(r.problem)
    if r.problem:
        return replace(r.info, warnings=(*r.info.warnings, r.problem))
    return r.info


def _q(text: str) -> str:
    """A value from node data, quoted for a one-line message (no control characters)."""
    shown = ascii(text)
    return shown if len(shown) <= 50 else shown[:47] + "..."


def _label_int(name: str, labels: Mapping[str, str], key: str, limit: int, least: int = 0) -> int | None:
    value = labels.get(key)
    if value is None or value == "":
        return None
    v = value.strip()
    if not v.isascii() or not v.isdigit() or not least <= int(v) <= limit:  # no sign, exponent or space
        raise NodeDataError(f"node {name}: label {key}={_q(value)} is not a whole number in {least}..{limit}")
    return int(v)


def _inventory(
    name: str,
    raw: Any,
    labels: Mapping[str, str],
    gpu_lookup: GpuLookup,
    now: datetime | None,
    warnings: list[str],
) -> GpuInventory | None:
    """The inventory if it can be used; None to fall back to GFD labels (with a warning); raises
    NodeDataError when it is malformed, out of range or not believable."""
    where = f"node {name}: annotation {defaults.INVENTORY_ANNOTATION}"
    if not isinstance(raw, str) or len(raw) > limits.MAX_INVENTORY_CHARS:
        raise NodeDataError(f"{where} is not a GPU inventory: more than {limits.MAX_INVENTORY_CHARS} characters")
    try:
        inv = GpuInventory.model_validate_json(raw)
    except ValueError as e:
        raise NodeDataError(f"{where} is not a GPU inventory: {one_line(e)}") from None
    if inv.schema_version > INVENTORY_SCHEMA_VERSION:
        warnings.append(f"{name}: inventory schema {inv.schema_version} is newer than {INVENTORY_SCHEMA_VERSION}; "
                        "reading the fields this vllmfit knows")
    if now is not None:
        age = attribution.age_seconds(inv, now)
        if age is None:
            raise NodeDataError(f"{where}: sampledAt {inv.sampled_at[:40]!r} is not an RFC 3339 time")
        if age > defaults.INVENTORY_STALE_SECONDS:  # a date in the future is clock skew: fresh
            warnings.append(f"{name}: node agent inventory is {int(age)} s old (more than "
                            f"{defaults.INVENTORY_STALE_SECONDS} s); ignored, using GFD labels")
            return None
    if not (inv.nvml and inv.gpus):
        warnings.append(f"{name}: node agent reports {inv.error or 'no GPUs'}; using GFD labels")
        return None
    _check_inventory(where, inv, labels, gpu_lookup)
    return inv


def _check_inventory(where: str, inv: GpuInventory, labels: Mapping[str, str], gpu_lookup: GpuLookup) -> None:
    """Physical limits, and agreement with GFD's labels and the catalog (vllmfit.core.limits)."""
    if len(inv.gpus) > limits.MAX_GPUS_PER_NODE:
        raise NodeDataError(f"{where}: {len(inv.gpus)} GPUs, more than {limits.MAX_GPUS_PER_NODE}")
    indices = [g.index for g in inv.gpus]
    if len(set(indices)) != len(indices):
        raise NodeDataError(f"{where}: a GPU index appears twice")
    count = labels.get(defaults.GFD_COUNT_LABEL, "").strip()
    if count.isdigit() and len(inv.gpus) > int(count):
        raise NodeDataError(f"{where}: reports {len(inv.gpus)} GPUs, GPU Feature Discovery counted {count}")
    gfd_product = labels.get(defaults.GFD_PRODUCT_LABEL, "").removesuffix("-SHARED")
    if gfd_product and not any(g.product and gfd_product.startswith(g.product) for g in inv.gpus):
        raise NodeDataError(f"{where}: no GPU is a {_q(gfd_product)}, the product GPU Feature Discovery labelled")
    gfd_mib = labels.get(defaults.GFD_MEMORY_LABEL, "").strip()
    for g in inv.gpus:
        at = f"{where}: GPU {g.index}"
        if g.index >= limits.MAX_GPUS_PER_NODE:
            raise NodeDataError(f"{at}: index out of range 0..{limits.MAX_GPUS_PER_NODE - 1}")
        if g.total_bytes > limits.MAX_GPU_MEMORY_BYTES:
            raise NodeDataError(f"{at}: {g.total_bytes} bytes is more memory than any GPU has")
        if 0 < g.total_bytes < limits.MIN_GPU_MEMORY_BYTES:
            raise NodeDataError(f"{at}: {g.total_bytes} bytes is less memory than any GPU has")
        if g.used_bytes > g.total_bytes and g.total_bytes > 0:
            raise NodeDataError(f"{at}: {g.used_bytes} bytes used of {g.total_bytes}")
        if len(g.processes) > limits.MAX_PROCESSES_PER_GPU or len(g.mig_devices) > limits.MAX_MIG_PER_GPU:
            raise NodeDataError(f"{at}: too many processes or MIG devices")
        if any(p.used_bytes > limits.MAX_GPU_MEMORY_BYTES for p in g.processes):
            raise NodeDataError(f"{at}: a process uses more memory than any GPU has")
        mig = [m.index for m in g.mig_devices]
        if len(set(mig)) != len(mig) or any(i >= limits.MAX_MIG_PER_GPU for i in mig):
            raise NodeDataError(f"{at}: MIG device indices must be distinct and below {limits.MAX_MIG_PER_GPU}")
        if sum(m.total_bytes for m in g.mig_devices) > g.total_bytes or any(
            m.used_bytes > m.total_bytes or sum(p.used_bytes for p in m.processes) > limits.MAX_GPU_MEMORY_BYTES
            for m in g.mig_devices
        ):
            raise NodeDataError(f"{at}: MIG devices hold more memory than the GPU")
        if g.total_bytes <= 0:
            continue  # unreadable GPU: offers no budget
        reference, source = _reference_bytes(g.product, gfd_mib, gpu_lookup)
        if reference is not None and g.total_bytes > reference * (1 + limits.GPU_MEMORY_TOLERANCE):
            raise NodeDataError(
                f"{at}: {_q(g.product)} with {g.total_bytes // defaults.MIB} MiB, but {source} says "
                f"{reference // defaults.MIB} MiB; not believed"
            )


def _reference_bytes(product: str, gfd_mib: str, gpu_lookup: GpuLookup) -> tuple[int | None, str]:
    """What a GPU of this product has: the catalog's figure, else the node's GFD memory label."""
    try:
        return gpu_lookup(product, None).memory_bytes, "the catalog"
    except LookupError:
        pass
    if gfd_mib.isdigit():
        return int(gfd_mib) * defaults.MIB, f"label {defaults.GFD_MEMORY_LABEL}"
    return None, ""


def _slots_from_inventory(
    name: str, inv: GpuInventory, gpu_lookup: GpuLookup, pods: Mapping[str, str], warnings: list[str]
) -> tuple[GpuSlot, ...]:
    usage = attribution.attribute(inv, pods)
    gpus = {g.index: g for g in inv.gpus}
    slots = []
    for idx, u in usage.units.items():
        g = gpus[u.gpu_index]
        if u.total_bytes <= 0:
            warnings.append(f"{name} GPU {g.index}: unusable ({g.error or 'no memory reported'})")
            continue
        if u.error:
            warnings.append(f"{name} GPU {g.index}: {u.error}")
        facts = gpu_lookup(g.product, g.total_bytes // defaults.MIB)
        if u.mig_index is not None:
            mig = next(m for m in g.mig_devices if m.index == u.mig_index)
            facts = mig_gpu_type(facts, mig.profile, mig.total_bytes)
        slots.append(GpuSlot(name, idx, facts, u.uuid, u.foreign_bytes, mig=u.mig_index is not None))
    return tuple(slots)
