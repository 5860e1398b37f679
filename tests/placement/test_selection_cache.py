"""The ledger's selection cache (`Ledger.selections`: nodeSelector and affinity matches, the nodes a
spec's tolerations keep out, per-set node counts and policy lines) survives a node change that
changes only foreign use (what the node agent reports most often; issue 32: a fleet-size walk of
every node per report); any other change keeps each nodeSelector's / affinity's matches with that
node looked at again (census.still_matching) and drops the rest: after random node changes, every
cached answer equals the one a fresh ledger of the same nodes computes."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_fakes import A100_40, H100, node, request

from vllmfit.core import memory, placement
from vllmfit.core.placement import search, summary
from vllmfit.core.placement.taints import Taint

GIB = 1 << 30
CHANGE = st.tuples(st.integers(0, 3), st.sampled_from(["foreign", "labels", "taint", "cordon", "gpus", "policy",
                                                       "add", "remove"]), st.integers(0, 2))
SPECS = [request("a/sel", placement={"nodeSelector": {"pool": "x"}}),
         request("a/all"),
         request("a/tol", placement={"nodeSelector": {"pool": "y"}},
                 podTemplate={"spec": {"tolerations": [{"key": "gpu", "operator": "Exists"}]}})]


def _node(name: str, pool: str, foreign: int, taint: bool, cordon: bool, a100: bool, adr: bool) -> placement.NodeInfo:
    policy = memory.BudgetPolicy(0.90, 2 * GIB, "adr", context_bytes=0) if adr else memory.DEFAULT_POLICY
    n = node(name, A100_40 if a100 else H100, 2, {"pool": pool}, {0: foreign * 10 * GIB}, policy=policy)
    return placement.NodeInfo(n.name, n.labels, n.gpus, taints=(Taint("gpu", "x"),) if taint else (),
                              unschedulable=cordon)


def _answers(ledger: placement.Ledger) -> list:
    out = []
    for req in SPECS:
        spec = req.spec
        matching = ledger.matching(spec.placement.node_selector, None)
        sched = search.schedulable(ledger, matching, spec)
        out.append((matching and (matching.names, matching.types), sched and (sched.names, sched.types),
                    summary.policy_line(ledger, matching), vars(summary.nodes_of_set(ledger, matching, 2)),
                    matching and summary.barred(ledger, matching, spec)))
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(CHANGE, min_size=1, max_size=12))
def test_cached_selections_equal_a_fresh_ledgers_after_any_node_change(changes: list) -> None:
    facts = {f"n{i}": [("x", "y")[i % 2], 0, False, False, False, False] for i in range(3)}
    ledger = placement.Ledger([_node(n, *f) for n, f in facts.items()])
    _answers(ledger)  # fill the cache
    for i, what, value in changes:
        name = f"n{i}"
        if what == "remove":
            facts.pop(name, None)
            ledger.remove_node(name)
        else:
            f = facts.setdefault(name, ["x", 0, False, False, False, False])
            col = {"labels": 0, "foreign": 1, "taint": 2, "cordon": 3, "gpus": 4, "policy": 5}.get(what)
            if col == 0:
                f[0] = ("x", "y", "z")[value]
            elif col == 1:
                f[1] = value
            elif col is not None:
                f[col] = not f[col]
            ledger.set_node(_node(name, *f))
        assert _answers(ledger) == _answers(placement.Ledger([_node(n, *f) for n, f in sorted(facts.items())]))


def test_a_change_of_foreign_use_alone_keeps_the_cache() -> None:
    ledger = placement.Ledger([_node("n0", "x", 0, False, False, False, False)])
    _answers(ledger)
    cache = ledger.selections
    ledger.set_node(_node("n0", "x", 2, False, False, False, False))
    assert ledger.selections is cache and len(cache)
    ledger.set_node(_node("n0", "y", 2, False, False, False, False))
    assert ledger.selections is not cache  # a new cache: the nodeSelector matches carried over with n0 looked at again,
    kept = ledger.selections.recent(len(ledger.selections))  # the per-set counts, taints and policies dropped
    assert kept and all(not isinstance(k[0], str) for k, _ in kept)
    assert ledger.matching({"pool": "x"}).names == () and ledger.matching({"pool": "y"}).names == ("n0",)
