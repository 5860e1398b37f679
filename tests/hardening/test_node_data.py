"""Node data read defensively (issue 14, items 1, 9, 10, 11): a bad annotation or label never
evicts a node or invents memory; limits come from vllmfit.core.limits."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllmfit.core import defaults, limits, placement
from vllmfit.sources import catalog

H100 = "NVIDIA-H100-80GB-HBM3"
H100_BYTES = 81559 * defaults.MIB  # catalog/gpus.yaml memory_mib
NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)
LABELS = {defaults.GFD_PRODUCT_LABEL: H100, defaults.GFD_COUNT_LABEL: "2", defaults.GFD_MEMORY_LABEL: "81559"}


def gpu(index: int, total: int = H100_BYTES, **kw: Any) -> dict[str, Any]:
    return {"index": index, "uuid": f"GPU-{index}", "product": H100, "totalBytes": total, "usedBytes": 0, **kw}


def inventory(gpus: list[dict[str, Any]], sampled: datetime = NOW, **kw: Any) -> str:
    return json.dumps({"schemaVersion": 1, "sampledAt": sampled.strftime("%Y-%m-%dT%H:%M:%SZ"), "nvml": True,
                       "gpus": gpus, **kw})


def node(labels: dict[str, str] | None = None, ann: str | None = None, name: str = "n") -> dict[str, Any]:
    annotations = {defaults.INVENTORY_ANNOTATION: ann} if ann is not None else {}
    return {"metadata": {"name": name, "labels": LABELS if labels is None else labels, "annotations": annotations}}


def read(obj: dict[str, Any], **kw: Any) -> placement.NodeRead:
    return placement.read_node(obj, catalog.gpu_for_label, now=NOW, **kw)


def test_a_good_inventory_is_read() -> None:
    r = read(node(ann=inventory([gpu(0), gpu(1, usedBytes=1 << 30)])))
    assert r.problem is None
    assert [(s.index, s.foreign_bytes) for s in r.info.gpus] == [(0, 0), (1, 1 << 30)]


def test_unknown_inventory_fields_are_ignored() -> None:
    # a newer agent (rolling upgrade) adds fields at every level: the node keeps its GPUs
    inv = json.loads(inventory([gpu(0, eccErrors=3, clocks={"sm": 1980}), gpu(1)]))
    inv.update(schemaVersion=2, topology={"nvlink": True})
    r = read(node(ann=json.dumps(inv)))
    assert r.problem is None and len(r.info.gpus) == 2
    assert any("schema 2 is newer" in w for w in r.warnings)


@pytest.mark.parametrize("ann,why", [
    ("{not json", "is not a GPU inventory"),
    (inventory([gpu(0, totalBytes=-5)]), "is not a GPU inventory"),
    (inventory([gpu(999)]), "index out of range"),
    (inventory([gpu(0), gpu(0)]), "appears twice"),
    (inventory([gpu(0, total=10**30)]), "more memory than any GPU"),
    (inventory([gpu(0, total=2 * H100_BYTES)]), "not believed"),
    (inventory([gpu(0, usedBytes=H100_BYTES + 1)]), "used of"),
    (inventory([gpu(i) for i in range(3)]), "GPU Feature Discovery counted 2"),
    (inventory([{**gpu(0), "product": "NVIDIA-B200"}]), "the product GPU Feature Discovery labelled"),
    (inventory([gpu(0)], sampled=NOW).replace("2026-06-01T12:00:00Z", "yesterday"), "not an RFC 3339 time"),
    ("x" * (limits.MAX_INVENTORY_CHARS + 1), "characters"),
])
def test_a_bad_inventory_keeps_the_last_good_state(ann: str, why: str) -> None:
    good = read(node(ann=inventory([gpu(0), gpu(1, usedBytes=5 << 30)]))).info
    r = read(node(ann=ann), previous=good)
    assert r.problem is not None and why in r.problem, r.problem
    assert r.info is good  # kept: never evicted, never replaced by the bad data
    assert len(r.problem.splitlines()) == 1


def test_a_bad_inventory_without_a_previous_state_falls_back_to_gfd_labels() -> None:
    r = read(node(ann=inventory([gpu(0, total=10**30)])))
    assert r.problem is not None
    assert [s.capacity_bytes for s in r.info.gpus] == [catalog.gpu(H100).cuda_total_bytes] * 2


@pytest.mark.parametrize("count", ["abc", "-3", "2000000", "1e3", " ", "2.5"])
def test_a_bad_gpu_count_label_is_a_problem_not_zero_gpus(count: str) -> None:
    previous = read(node()).info
    r = read(node({**LABELS, defaults.GFD_COUNT_LABEL: count}), previous=previous)
    assert r.problem is not None and defaults.GFD_COUNT_LABEL in r.problem or "no GPU information" in r.problem
    assert r.info is previous


def test_two_million_gpus_is_refused_without_building_them() -> None:
    r = read(node({**LABELS, defaults.GFD_COUNT_LABEL: "2000000"}))
    assert r.info is None and f"0..{limits.MAX_GPUS_PER_NODE}" in r.problem


def test_the_largest_real_count_is_read() -> None:
    r = read(node({**LABELS, defaults.GFD_COUNT_LABEL: str(limits.MAX_GPUS_PER_NODE)}))
    assert r.problem is None and len(r.info.gpus) == limits.MAX_GPUS_PER_NODE


def test_a_stale_inventory_is_ignored_with_a_warning() -> None:
    old = NOW - timedelta(seconds=defaults.INVENTORY_STALE_SECONDS + 1)
    r = read(node(ann=inventory([gpu(0, usedBytes=40 << 30), gpu(1)], sampled=old)))
    assert r.problem is None
    assert any("ignored, using GFD labels" in w for w in r.warnings)
    assert [s.foreign_bytes for s in r.info.gpus] == [0, 0]  # the labels' GPUs, not the stale use
    fresh = read(node(ann=inventory([gpu(0, usedBytes=40 << 30), gpu(1)], sampled=NOW - timedelta(seconds=30))))
    assert [s.foreign_bytes for s in fresh.info.gpus] == [40 << 30, 0]


def test_a_cpu_only_node_is_no_problem() -> None:
    r = read(node(labels={"kubernetes.io/os": "linux"}))
    assert r.info is None and r.problem is None and not r.has_gpu_data


def test_an_unknown_product_is_checked_against_the_gfd_memory_label() -> None:
    labels = {defaults.GFD_PRODUCT_LABEL: "ACME-X1", defaults.GFD_COUNT_LABEL: "1", defaults.GFD_MEMORY_LABEL: "4000"}
    ok = read(node(labels, inventory([{**gpu(0, total=4000 * defaults.MIB), "product": "ACME-X1"}])))
    assert ok.problem is None and ok.info.gpus[0].gpu.memory_bytes == 4000 * defaults.MIB
    bad = read(node(labels, inventory([{**gpu(0, total=100 << 30), "product": "ACME-X1"}])))
    assert bad.problem is not None and "label nvidia.com/gpu.memory says 4000 MiB" in bad.problem


# --- Property: whatever a node object holds, reading it never raises and never invents memory ----

leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
anything = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                        max_leaves=8)
value = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from([0, 1, 999, 10**30, -1]),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.none())
gpu_field = st.sampled_from(["index", "totalBytes", "usedBytes", "product", "processes", "migEnabled",
                             "migDevices", "unknownField"])


@st.composite
def malformed_gpu(draw: st.DrawFn) -> dict[str, Any]:
    g = gpu(draw(st.integers(min_value=0, max_value=3)))
    for k, v in draw(st.dictionaries(gpu_field, st.one_of(value, anything), max_size=3)).items():
        g[k] = v
    return g


@st.composite
def malformed_node(draw: st.DrawFn) -> dict[str, Any]:
    labels = dict(LABELS)
    for k in draw(st.lists(st.sampled_from(list(LABELS)), max_size=3)):
        labels[k] = draw(st.one_of(st.text(max_size=10), st.sampled_from(["-3", "2000000", "1e30", "8", "0"])))
    inv = json.loads(inventory([draw(malformed_gpu()) for _ in range(draw(st.integers(0, 3)))]))
    for k, v in draw(st.dictionaries(st.sampled_from(["schemaVersion", "sampledAt", "nvml", "gpus", "extra"]),
                                     st.one_of(value, anything), max_size=2)).items():
        inv[k] = v
    ann = draw(st.one_of(st.just(json.dumps(inv, allow_nan=True)), st.text(max_size=20), st.none()))
    return node(labels, ann)


@settings(max_examples=int(os.environ.get("VLLMFIT_FUZZ_EXAMPLES", "300")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(malformed_node())
def test_property_malformed_node_objects(obj: dict[str, Any]) -> None:
    previous = read(node()).info
    r = read(obj, previous=previous)  # never raises
    labels = obj["metadata"]["labels"]
    if r.info is None:  # only when no source claims GPUs at all (empty labels, agent reports none)
        assert r.problem is None
        assert not (labels[defaults.GFD_PRODUCT_LABEL] and labels[defaults.GFD_COUNT_LABEL])
        return
    if r.problem:
        assert len(r.problem.splitlines()) == 1 and r.problem.startswith("node n")
    for s in r.info.gpus:
        assert 0 <= s.index < limits.MAX_GPUS_PER_NODE or 1000 <= s.index < 1000 * (limits.MAX_GPUS_PER_NODE + 1)
        assert 0 < s.capacity_bytes <= limits.MAX_GPU_MEMORY_BYTES
        assert s.foreign_bytes >= 0
        if s.gpu.product == H100:  # never more than the catalog's H100
            assert s.capacity_bytes <= catalog.gpu(H100).cuda_total_bytes
    assert len(r.info.gpus) <= limits.MAX_GPUS_PER_NODE * limits.MAX_MIG_PER_GPU
