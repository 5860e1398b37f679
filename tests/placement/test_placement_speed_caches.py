"""The full plan's caches (issue 32) are exact: interned settings, cached validation, the whole-node
group index kept as nodes come, and the collector paused only while `vllmfit plan` runs."""

from __future__ import annotations

import gc

from hypothesis import given
from hypothesis import strategies as st
from placement_fakes import A100_40, H100, LLAMA_8B, node, request

from vllmfit.cli.plan import collector_paused
from vllmfit.core import placement
from vllmfit.core.placement.inputs import settings_from_spec
from vllmfit.core.spec.api import VLLMDeploymentSpec


def _spec(**kw: object) -> VLLMDeploymentSpec:
    return VLLMDeploymentSpec.model_validate({"model": "meta-llama/Llama-3.1-8B-Instruct", **kw})


def test_equal_specs_share_one_settings_object_and_different_ones_do_not() -> None:
    a = settings_from_spec(_spec(maxModelLen=8192, kvCache={"concurrency": 4}))
    b = settings_from_spec(_spec(maxModelLen=8192, kvCache={"concurrency": 4}))
    assert a is b  # built and hashed once; sizing caches find it by identity
    for other in (_spec(maxModelLen=4096, kvCache={"concurrency": 4}), _spec(maxModelLen=8192),
                  _spec(maxModelLen=8192, kvCache={"concurrency": 4}, lora={"maxLoras": 2}),
                  _spec(maxModelLen=8192, kvCache={"concurrency": 4, "grow": True})):
        assert settings_from_spec(other) != a
    assert settings_from_spec(_spec(), policy="adr") != settings_from_spec(_spec())


def test_a_new_ledger_keeps_the_whole_node_group_index_as_one_built_later_would() -> None:
    nodes = [node(f"n{i}", H100, 8) for i in range(3)] + [node("m", [H100, H100, A100_40, A100_40])]
    ledger = placement.Ledger(nodes)
    d = placement.decide(ledger, request("a/x", LLAMA_8B, tensorParallelSize=2))
    ledger.book(d)
    eager = {k: list(ledger.group_index(*k)) for k in list(ledger._groups)}  # as read: keys of booked nodes refreshed
    assert (H100, 8) in eager and (H100, 2) in eager and (A100_40, 2) in eager  # whole nodes of each type
    ledger._groups.clear()
    ledger._group_key.clear()
    for (t, n), entries in eager.items():  # built lazily from the same ledger: the same entries
        assert ledger.group_index(t, n) == entries


def test_the_plan_command_restores_the_collector_as_it_found_it_and_the_core_never_turns_it(monkeypatch) -> None:
    nodes, reqs = [node("n0", H100, 2)], [request("a/x", LLAMA_8B)]
    assert gc.isenabled()
    turned: list[str] = []
    with monkeypatch.context() as m:
        m.setattr(gc, "disable", lambda: turned.append("disable"))
        placement.plan(nodes, reqs)
    assert turned == []  # the core: a process-wide switch is a shell's (cli.plan.collector_paused)
    with collector_paused():
        assert not gc.isenabled()
        placement.plan(nodes, reqs)
        assert not gc.isenabled()
    assert gc.isenabled() and not gc.get_freeze_count()  # nothing left frozen for good
    gc.disable()
    try:
        with collector_paused():
            placement.plan(nodes, reqs)
        assert not gc.isenabled()
    finally:
        gc.enable()


@given(st.lists(st.sampled_from([0, 1, 7, 999, 1000, 1001, 2003]), min_size=2, max_size=8))
def test_a_group_is_named_as_its_gpus_labels_say(gpus: list[int]) -> None:
    """`where` names whole GPUs by their indices at once (a 1,000-replica admission names 8,000):
    the same words as each GPU's label."""
    from vllmfit.core.placement.inputs import gpu_label, where

    assert where("n", gpus) == f"n GPU {','.join(gpu_label(i).removeprefix('GPU ') for i in gpus)}"
