"""Reading a node's GPUs from cluster objects: GPU Feature Discovery labels and the node agent's
inventory annotation (MIG slices and foreign use included)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllmfit.core import defaults, observe
from vllmfit.core.api import GpuInventory
from vllmfit.core.modelarch import GpuType
from vllmfit.core.placement.inputs import GpuLookup, GpuSlot, NodeInfo


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
    )


def node_from_object(
    obj: Mapping[str, Any], gpu_lookup: GpuLookup, pods: Mapping[str, str] | None = None
) -> NodeInfo:
    """A v1/Node -> its schedulable GPUs. The agent's inventory annotation wins over GFD labels.

    `gpu_lookup(product, memory_mib)` resolves a product name to catalog facts (the caller passes
    vllmfit.sources.catalog.gpu_for_label); it raises LookupError for an unknown product without memory.
    `pods` maps the UIDs of vllmfit's pods to their deployment: their memory is booked in the
    ledger, everything else in use is foreign (vllmfit.core.observe's rule; without `pods`, all
    memory in use is foreign). A MIG-enabled GPU is replaced by its slices (unit index
    1000 x (gpu + 1) + slice). Raises ValueError when the node has no GPU information at all.
    """
    meta = obj.get("metadata") or {}
    name = str(meta.get("name") or "")
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    annotations = meta.get("annotations") or {}
    warnings: list[str] = []
    raw = annotations.get(defaults.INVENTORY_ANNOTATION)
    if raw:
        try:
            inv = GpuInventory.model_validate_json(raw)
        except ValueError as e:
            raise ValueError(
                f"node {name}: annotation {defaults.INVENTORY_ANNOTATION} is not a GPU inventory: "
                f"{str(e).splitlines()[0]}"
            ) from None
        if inv.nvml and inv.gpus:
            return NodeInfo(
                name,
                labels,
                _slots_from_inventory(name, inv, gpu_lookup, pods or {}, warnings),
                tuple(warnings),
            )
        warnings.append(f"{name}: node agent reports {inv.error or 'no GPUs'}; using GFD labels")
    product = labels.get(defaults.GFD_PRODUCT_LABEL)
    count = labels.get(defaults.GFD_COUNT_LABEL)
    if not product or not count:
        raise ValueError(
            f"node {name} has no GPU information: needs the {defaults.GFD_PRODUCT_LABEL} and "
            f"{defaults.GFD_COUNT_LABEL} labels (GPU Feature Discovery) or the "
            f"{defaults.INVENTORY_ANNOTATION} annotation (vllmfit agent)"
        )
    mem = labels.get(defaults.GFD_MEMORY_LABEL)
    try:
        facts = gpu_lookup(product, int(mem) if mem else None)
        n = int(count)
    except ValueError as e:
        raise ValueError(f"node {name}: {e}") from None
    return NodeInfo(name, labels, tuple(GpuSlot(name, i, facts) for i in range(n)), tuple(warnings))


def _slots_from_inventory(
    name: str, inv: GpuInventory, gpu_lookup: GpuLookup, pods: Mapping[str, str], warnings: list[str]
) -> tuple[GpuSlot, ...]:
    usage = observe.attribute(inv, pods)
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
