"""`Ledger.matching` (a nodeSelector's and required node affinity's matching nodes) is cached, and a
node's change in what a selection reads (labels, taints, cordon, GPUs) or its removal updates each
cached answer with that one node looked at again (census.still_matching), instead of dropping the
cache and walking every node on the next review (issue 32). Exact: after any sequence of node
changes, removals, snapshots and queries, every answer (names and GPU types) equals a plain walk of
the nodes, on the ledger and on each snapshot, and a snapshot's answers never move with the ledger."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_fakes import A100_40, H100, L4, node

from vllmfit.core import placement
from vllmfit.core.placement.taints import Taint

TYPES = (H100, A100_40, L4)
NAMES = ("n0", "n1", "n2", "n3")
LABELS = st.dictionaries(st.sampled_from(["pool", "zone"]), st.sampled_from(["a", "b"]), max_size=2)
GPUS = st.lists(st.sampled_from(range(3)), max_size=3)
QUERIES = [({"pool": "a"}, None), ({"pool": "a", "zone": "b"}, None), ({"zone": "a"}, None),
           (None, (((("pool", "In", ("b",)),), ()),)), ({"zone": "b"}, (((("pool", "NotIn", ("a",)),), ()),)),
           (None, (((), (("metadata.name", "In", ("n1", "n2")),)),))]
OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), st.sampled_from(NAMES), LABELS, GPUS, st.booleans()),
    st.tuples(st.just("remove"), st.sampled_from(NAMES)),
    st.tuples(st.just("query"), st.integers(0, len(QUERIES) - 1)),
    st.tuples(st.just("snapshot"),),
), max_size=40)


def _walk(ledger: placement.Ledger, selector: dict | None, terms: tuple | None) -> tuple:
    """The matching nodes' names and GPU types by a plain walk of every node."""
    from vllmfit.core.placement import affinity

    names = sorted(n for n, nd in ledger.nodes.items() if all(nd.labels.get(k) == v for k, v in (selector or {}).items())
                   and affinity.terms_match(n, nd.labels, terms))
    types = sorted({s.gpu.product for n in names for s in ledger.nodes[n].gpus})
    return tuple(names), tuple(types)


def _answer(ledger: placement.Ledger, selector: dict | None, terms: tuple | None) -> tuple:
    found = ledger.matching(selector, terms)
    assert found is not None
    assert found.members == frozenset(found.names)
    return found.names, tuple(t.product for t in found.types)


def _node(name: str, labels: dict, gpus: list, tainted: bool) -> placement.NodeInfo:
    nd = node(name, [TYPES[g] for g in gpus], labels=labels)
    return nd if not tainted else placement.NodeInfo(nd.name, nd.labels, nd.gpus,
                                                     taints=(Taint("gpu", "x", "NoSchedule"),))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_matching_after_any_node_changes_equals_a_walk(ops: list) -> None:
    ledger = placement.Ledger([node("n0", H100, 2, {"pool": "a"}), node("n1", A100_40, 1, {"pool": "b", "zone": "a"})])
    snaps: list[tuple[placement.Ledger, list]] = []
    for op in ops:
        if op[0] == "set":
            ledger.set_node(_node(*op[1:]))
        elif op[0] == "remove":
            ledger.remove_node(op[1])
        elif op[0] == "query":
            sel, terms = QUERIES[op[1]]
            assert _answer(ledger, sel, terms) == _walk(ledger, sel, terms)
        else:
            snap = ledger.snapshot()
            snaps.append((snap, [_answer(snap, *q) for q in QUERIES]))
    for sel, terms in QUERIES:
        assert _answer(ledger, sel, terms) == _walk(ledger, sel, terms)
    for snap, seen in snaps:
        assert [_answer(snap, *q) for q in QUERIES] == seen == [_walk(snap, *q) for q in QUERIES]
