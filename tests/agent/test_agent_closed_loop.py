"""The closed loop from the agent's own sampling (issue 34): a fake NVML and /proc underneath the
real `collect`, the inventory it publishes, and the core's rules on it (stability, the booking
rule, the start gate), as the operator applies them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from agent_fakes import (
    CID_A,
    CID_B,
    GIB,
    H100_TOTAL,
    MIB,
    POD_A,
    POD_B,
    FakeGpu,
    FakeNVML,
    FakeProc,
    write_proc,
)

from vllmfit.agent import nvml as agent_nvml
from vllmfit.agent import publish
from vllmfit.core import defaults, memory, placement
from vllmfit.core.observe import attribution
from vllmfit.core.observe.inventory import GpuInventory
from vllmfit.core.placement import observed
from vllmfit.core.placement.decision import Booking
from vllmfit.sources import catalog

NOW = datetime(2030, 1, 1, tzinfo=UTC)
UUID = "GPU-11111111-0000-0000-0000-000000000000"
PREDICTED = 20 * GIB


def sample(tmp_path: Path, vllm: int, foreign: int = 0, at: datetime = NOW) -> GpuInventory:
    """One agent sample: replica 0 of ns/llama (POD_A) uses `vllm` bytes, another pod `foreign`."""
    write_proc(tmp_path, 1001, f"0::/kubepods.slice/kubepods-pod{POD_A.replace('-', '_')}.slice/"
                               f"cri-containerd-{CID_A}.scope\n")
    write_proc(tmp_path, 1002, f"0::/kubepods/besteffort/pod{POD_B}/{CID_B}\n")
    procs = [FakeProc(1001, vllm)] + ([FakeProc(1002, foreign)] if foreign else [])
    fake = FakeNVML([FakeGpu(UUID, "NVIDIA H100 80GB HBM3", H100_TOTAL, used=vllm + foreign, procs=procs)])
    inv = agent_nvml.collect(nvml=fake, proc_root=tmp_path, now=at)
    return GpuInventory.model_validate_json(publish.to_json(inv))  # what the operator reads back


def ledger() -> placement.Ledger:
    fp = memory.Footprint(weights=PREDICTED, kv_cache=0, activation=0, cuda_context=0, non_torch=0, cuda_graphs=0)
    lg = placement.Ledger([placement.NodeInfo("gpu-a", {}, (placement.GpuSlot(
        "gpu-a", 0, catalog.gpu("NVIDIA-H100-80GB-HBM3"), UUID),))])
    lg.restore("ns/llama", [Booking("ns/llama", 0, "gpu-a", 0, fp)])
    return lg


def measured(inv: GpuInventory, started: bool) -> list[observed.Measured]:
    att = attribution.attribute(inv, {POD_A: "ns/llama#0"})  # the operator's per-replica view
    return [observed.Measured(who.rpartition("#")[0], 0, "gpu-a", i, n, started)
            for who, units in att.by_deployment.items() for i, n in units.items()]


def test_a_model_using_2_gib_more_is_booked_with_it_one_agent_interval_after_it_settles(tmp_path: Path) -> None:
    lg = ledger()
    first = sample(tmp_path, PREDICTED + 2 * GIB - 40 * MIB)
    second = sample(tmp_path, PREDICTED + 2 * GIB, at=NOW + timedelta(seconds=defaults.AGENT_PUBLISH_SECONDS))
    [m1], [m2] = measured(first, False), measured(second, False)
    assert (m1.used_bytes, m2.used_bytes) == (PREDICTED + 2 * GIB - 40 * MIB, PREDICTED + 2 * GIB)
    # the first sample alone starts nothing; the second, within 64 MiB of it, does
    assert not observed.stable(None, (first.sampled_at, m1.used_bytes))
    assert observed.stable((first.sampled_at, m1.used_bytes), (second.sampled_at, m2.used_bytes))
    assert observed.apply(lg, observed.change(lg, measured(second, True))) == []
    assert lg.bookings_of("ns/llama")[0].footprint.total == PREDICTED + 2 * GIB + defaults.OBSERVED_MARGIN_BYTES
    assert lg.used_bytes("gpu-a", 0) == PREDICTED + 2 * GIB + defaults.OBSERVED_MARGIN_BYTES


def test_a_foreign_process_after_admission_holds_the_start_of_a_replica_it_leaves_no_room_for(
        tmp_path: Path) -> None:
    lg = ledger()
    foreign = H100_TOTAL - PREDICTED + GIB  # a process of another pod: 1 GiB less free than llama needs
    inv = sample(tmp_path, 0, foreign=foreign)
    att = attribution.attribute(inv, {POD_A: "ns/llama#0"})
    [unit] = att.units.values()
    assert unit.foreign_bytes == foreign and unit.free_bytes == PREDICTED - GIB
    age = (NOW + timedelta(seconds=5) - NOW).total_seconds()
    gate = observed.start_gate(lg, "ns/llama", 0, {0: unit.free_bytes}, age, lambda k, r: False)
    assert not gate.open
    assert gate.reason == "held: gpu-a GPU 0 has 19.0 GiB free (agent), this replica needs 20.0 GiB"
    inv = sample(tmp_path, 0, foreign=foreign - 2 * GIB)  # it shrank: room again
    [unit] = attribution.attribute(inv, {POD_A: "ns/llama#0"}).units.values()
    assert observed.start_gate(lg, "ns/llama", 0, {0: unit.free_bytes}, age, lambda k, r: False).open
