"""Ledger snapshots and forks (issue 29): structural sharing never leaks a change.

Random streams of changes (book, release, foreign use changing, a node leaving or coming back)
on a writer's ledger, taking snapshots and forks along the way and changing the forks too:
every snapshot still shows exactly what the ledger showed when it was taken (headroom of every
GPU, every booking, the indices equal a recount), every fork shows what a deep copy changed the
same way shows, and deciding on a snapshot changes nothing. The expected states are recorded
from the ledger itself at the moment, not from the sharing code.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_fakes import H100, L4, LLAMA_8B, QWEN_05B, QWEN_7B, check_indices, node, request

from vllmfit.core import placement
from vllmfit.core.placement import layers

GIB = 1 << 30
MODELS = (QWEN_05B, LLAMA_8B, QWEN_7B)


def state(led: placement.Ledger) -> tuple:
    """Everything a reader can see, as plain values."""
    return (
        sorted(led.nodes),
        [(s.node, s.index, led.used_bytes(s.node, s.index), led.headroom_bytes(s.node, s.index)) for s in led.slots()],
        {k: [(b.replica, b.node, b.index, b.footprint.total) for b in led.bookings_of(k)] for k in led.deployments()},
    )


def step(led: placement.Ledger, rnd: random.Random, i: int) -> None:
    what = rnd.random()
    if what < 0.55 or not led.deployments():
        req = request(f"d{i}", rnd.choice(MODELS), maxModelLen=rnd.choice([2048, 8192]),
                      tensorParallelSize=rnd.choice([1, 1, 2]), replicas=rnd.choice([1, 2]),
                      kvCache={"concurrency": rnd.choice([1, 4])})
        d = placement.decide(led, req)
        if d.admitted:
            led.book(d)
    elif what < 0.8:
        led.release(rnd.choice(led.deployments()))
    elif what < 0.9:
        name = rnd.choice(["n0", "n1", "n2"])
        led.set_node(node(name, H100 if name != "n2" else L4, 2, foreign={0: rnd.choice([0, 8 * GIB])}))
    else:
        led.remove_node(rnd.choice(["n1", "n2"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), compact=st.sampled_from([2, 256]))
def test_snapshots_stay_as_taken_and_forks_change_alone(seed: int, compact: int) -> None:
    rnd = random.Random(seed)
    old = layers._COMPACT
    layers._COMPACT = compact  # small: the layers merge their changes often
    try:
        led = placement.Ledger([node("n0", H100, 2), node("n1", H100, 4), node("n2", L4, 2)])
        taken: list[tuple[placement.Ledger, tuple]] = []
        forks: list[tuple[placement.Ledger, placement.Ledger]] = []  # (fork, the same changes on a fresh copy)
        for i in range(40):
            step(led, rnd, i)
            if rnd.random() < 0.3:
                snap = led.snapshot()
                taken.append((snap, state(led)))
                placement.decide(snap, request("probe", QWEN_7B, replicas=2, maxModelLen=8192))
                if snap.deployments():  # an update of a deployment it holds: set aside, given back
                    placement.decide(snap, request(rnd.choice(snap.deployments()).split("/")[1], QWEN_05B))
                assert state(snap) == taken[-1][1], "deciding on a snapshot changed it"
            if rnd.random() < 0.2:
                twin = placement.Ledger(led.nodes.values())
                for k in led.deployments():
                    twin.restore(k, led.bookings_of(k))
                forks.append((led.fork(), twin))
            for fork, twin in forks:
                if rnd.random() < 0.3:
                    j = rnd.randrange(10**6)
                    step(fork, random.Random(j), 1000 + i)
                    step(twin, random.Random(j), 1000 + i)
        for snap, seen in taken:
            assert state(snap) == seen
            check_indices(snap)
        for fork, twin in forks:
            assert state(fork) == state(twin)
            check_indices(fork)
        check_indices(led)
    finally:
        layers._COMPACT = old


def test_a_snapshot_refuses_changes() -> None:
    snap = placement.Ledger([node("n0", H100, 1)]).snapshot()
    for change in (lambda: snap.set_node(node("n1", H100, 1)), lambda: snap.remove_node("n0"),
                   lambda: snap.restore("default/a", [])):
        with pytest.raises(TypeError, match="never changes"):
            change()


def test_a_layer_alone_on_its_base_changes_it_in_place_until_shared() -> None:
    """A ledger never shared pays nothing for sharing; once a layer is made over it, neither
    side changes the base they share."""
    a = layers.Layer({}, own=True)
    a["x"] = 1
    assert a.base == {"x": 1} and a.delta == {}
    b = layers.Layer.over(a)
    a["y"], b["z"] = 2, 3
    a.pop("x")
    assert a.base == {"x": 1} and b.base is a.base  # shared, unchanged
    assert dict(a.items()) == {"y": 2} and dict(b.items()) == {"x": 1, "z": 3}
