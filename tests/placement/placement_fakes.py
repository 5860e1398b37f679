"""Builders and checks shared by the placement tests (imported as a plain module, like agent_fakes)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hypothesis import strategies as st

from vllmfit.core import memory, placement
from vllmfit.core.defaults import GIB
from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement import place
from vllmfit.core.spec.api import VLLMDeploymentSpec
from vllmfit.sources import catalog

H100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
A100_40 = catalog.gpu("NVIDIA-A100-SXM4-40GB")
L4 = catalog.gpu("NVIDIA-L4")
LLAMA_8B = catalog.model("meta-llama/Llama-3.1-8B-Instruct")
QWEN_05B = catalog.model("Qwen/Qwen2.5-0.5B-Instruct")
QWEN_7B = catalog.model("Qwen/Qwen2.5-7B-Instruct")

# Hand-computed budgets (ADR-0002: int(0.90 x cudaMemGetInfo total) - 2 GiB):
H100_T = 85031714816  # catalog/gpus.yaml cuda_total_bytes
H100_BUDGET = 76528543334 - 2147483648  # adr-0002: int(0.9 x 85031714816) = int(76528543334.4), - 2 GiB
assert H100_BUDGET == 74381059686


def node(
    name: str,
    gpus: Iterable[GpuType] | GpuType,
    count: int = 1,
    labels: Mapping[str, str] | None = None,
    foreign: Mapping[int, int] | None = None,
    policy: memory.BudgetPolicy = memory.DEFAULT_POLICY,
) -> placement.NodeInfo:
    types = [gpus] * count if isinstance(gpus, GpuType) else list(gpus)
    slots = tuple(
        placement.GpuSlot(name, i, t, foreign_bytes=(foreign or {}).get(i, 0), policy=policy)
        for i, t in enumerate(types)
    )
    return placement.NodeInfo(name, dict(labels or {}), slots)


def request(name: str, model: Any = LLAMA_8B, order: str = "", **spec: Any) -> placement.Request:
    key = name if "/" in name else f"default/{name}"
    return placement.Request(
        key, VLLMDeploymentSpec.model_validate({"model": model.name, **spec}), model, (order, key)
    )


def check_invariant(ledger: placement.Ledger) -> None:
    """Every GPU with bookings: bookings + foreign <= budget; the books add up; the indices
    match a recount."""
    for sl in ledger.slots():
        booked = sum(b.footprint.total for b in ledger.bookings_on(sl.node, sl.index))
        assert ledger.used_bytes(sl.node, sl.index) == booked + sl.foreign_bytes
        if booked:  # foreign use alone may exceed a budget; vllmfit then books nothing there
            assert booked + sl.foreign_bytes <= sl.budget_bytes, (sl.node, sl.index, booked, sl.budget_bytes)
    check_indices(ledger)


def check_indices(ledger: placement.Ledger) -> None:
    """The headroom indices equal the ones a fresh count gives."""
    by_type: dict[GpuType, list[tuple[int, str, int]]] = {}
    for sl in ledger.slots():
        by_type.setdefault(sl.gpu, []).append((ledger.headroom_bytes(sl.node, sl.index), sl.node, sl.index))
    assert {t: sorted(v) for t, v in by_type.items()} == {t: v for t, v in ledger._free.items()}
    for t, n in list(ledger._groups):  # read through group_index: it brings the keys of nodes booked since up to date
        lst = ledger.group_index(t, n)
        expect = []
        for name, info in ledger.nodes.items():
            heads = sorted(
                (ledger.headroom_bytes(name, s.index) for s in info.gpus if s.gpu == t and not s.mig),
                reverse=True,
            )
            if len(heads) >= n:
                expect.append((heads[n - 1], name))
        assert sorted(expect) == lst


def start_order_ok(
    capacity: int,
    foreign: int,
    procs: list[tuple[int, float, int]],
    order: Iterable[int],
    ceil_r: bool = True,
) -> bool:
    """vLLM's start-up check, process by process in `order`: each k needs
    free0 = T - (what the started ones hold) - foreign - own context >= R_k = ceil(T x u_k).
    procs: (context bytes, u, bytes held outside context + R once running, e.g. CUDA graphs before 0.21)."""
    import math

    held = foreign
    for k in order:
        ctx, u, extra = procs[k]
        r = math.ceil(capacity * u) if ceil_r else int(capacity * u)
        free0 = capacity - held - ctx
        if free0 < r:
            return False
        held += ctx + r + extra
    return True


def gib(x: float) -> int:
    return int(x * GIB)


def adr_footprint(need: int, capacity: int) -> int:
    """ADR policy footprint: R = ceil(T x u) for the smallest 4-decimal u with R >= need."""
    u_num = -(-need * 10_000 // capacity)  # ceil(need x 10^4 / T)
    return -(-capacity * u_num // 10_000)  # ceil(T x u)


def settings(req: placement.Request, policy: memory.Policy = "vllm") -> memory.Settings:
    return placement.settings_from_spec(req.spec, policy)


def _mig_type() -> GpuType:
    """A MIG slice's GPU type (3g.40gb of an A100 80GB), as the agent's inventory reports it."""
    from vllmfit.core.observe.inventory import GpuInventory, InventoryGpu, InventoryMigDevice

    inv = GpuInventory(sampled_at="2025-01-01T00:00:00Z", gpus=[InventoryGpu(
        index=0, uuid="GPU-0", product="NVIDIA-A100-SXM4-80GB", total_bytes=85899345920, mig_enabled=True,
        mig_devices=[InventoryMigDevice(index=0, uuid="MIG-a", profile="3g.40gb", total_bytes=42144366592)])])
    obj = {"metadata": {"name": "m", "labels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                                                 "nvidia.com/gpu.count": "1"},
                        "annotations": {"vllmfit.dev/gpu-inventory": inv.model_dump_json(by_alias=True)}}}
    return placement.node_from_object(obj, catalog.gpu_for_label).gpus[0].gpu


MIG = _mig_type()


# --- generated clusters (hypothesis): the reasons, bound and bulk tests share them ---------------------


KINDS = [H100, L4, MIG]
SPECS = [
    {"maxModelLen": 16384, "maxNumSeqs": 8},
    {"maxModelLen": 131072, "maxNumSeqs": 8},
    {"tensorParallelSize": 2, "maxModelLen": 65536, "maxNumSeqs": 16},
    {"tensorParallelSize": 4, "maxModelLen": 131072, "maxNumSeqs": 32, "maxNumBatchedTokens": 8192},
    {"maxModelLen": 32768, "placement": {"nodeSelector": {"pool": "a"}}},
    {"tensorParallelSize": 2, "placement": {"nodeSelector": {"pool": "b"}}},
]


@st.composite
def clusters(draw):
    out = []
    for k in range(draw(st.integers(1, 20))):
        kinds = draw(st.lists(st.sampled_from(KINDS), min_size=0, max_size=5))
        slots = []
        for i, t in enumerate(kinds):
            mig = t is MIG
            slots.append(placement.GpuSlot(f"n{k:02d}", 2000 + i if mig else i, t, mig=mig,
                                           foreign_bytes=draw(st.sampled_from([0, 4 * GIB, 40 * GIB, 70 * GIB]))))
        out.append(placement.NodeInfo(f"n{k:02d}", {"pool": draw(st.sampled_from("ab"))}, tuple(slots)))
    return out


@st.composite
def fleets(draw):
    """Mostly single-type nodes (as real node pools are), some mixed, some with an invalid budget
    policy, tainted or cordoned; every node's GPU type a distinct but equal object, as nodes read
    one by one have them."""
    import dataclasses

    from vllmfit.core.placement.taints import Taint

    out = []
    for k in range(draw(st.integers(1, 24))):
        kind = draw(st.sampled_from([H100, L4, A100_40, "mixed", "none"]))
        if kind == "mixed":
            kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
        elif kind == "none":
            kinds = []
        else:
            kinds = [dataclasses.replace(kind)] * draw(st.integers(1, 8))
        slots = tuple(placement.GpuSlot(f"n{k:02d}", 2000 + i if t is MIG else i, t, mig=t is MIG,
                                        foreign_bytes=draw(st.sampled_from([0, 4 * GIB, 40 * GIB])))
                      for i, t in enumerate(kinds))
        extra = draw(st.sampled_from(["", "", "error", "taint", "cordon"]))
        out.append(placement.NodeInfo(
            f"n{k:02d}", {"pool": draw(st.sampled_from("ab"))}, slots,
            error="budget policy: budget utilization 2 (node pool label) is outside [0, 1]" if extra == "error" else None,
            taints=(Taint("gpu", "x", "NoSchedule"),) if extra == "taint" else (),
            unschedulable=extra == "cordon"))
    return out


def bulk_and_one_by_one(ledger: placement.Ledger, req: placement.Request, **kw: object) -> tuple[placement.Decision, ...]:
    """The decision with bulk placement, then replica by replica."""
    out = []
    for on in (True, False):
        place.BULK = on
        try:
            out.append(placement.decide(ledger, req, **kw))  # type: ignore[arg-type]
        finally:
            place.BULK = True
    return tuple(out)
