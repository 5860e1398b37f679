"""What a set of nodes has, summed once per set of nodes instead of once per GPU per review (issue 32).

Derived, read-only views of a ledger's nodes: built on first use and kept in the ledger's
selection cache (`Ledger.remembered`: bounded, one per node state), whose entries here are dropped whenever a node is added,
changed or removed (a change of foreign use alone keeps them: nothing here reads it,
`NodeInfo.selected_as`; the matches themselves are updated, census.still_matching), so
they are as current as the nodes themselves. For every node (no selector), they are
read from the ledger's census (core.placement.census), kept as nodes change, so a review after a
node changed walks no nodes; a selector's set is walked once per node state. Headroom is not summed
here: it changes with every booking and is read from the ledger's own sorted indices (`free_index`,
`group_index`).

- `nodes_of_set`: per node set, the nodes with one GPU type (counted per type and per GPU count)
  and the few with several types (answered node by node), the nodes with an invalid budget policy
  (counted per message) and the GPU-less ones; what a refusal's reasons count.
- `policy_line`: the budget policies of a node set and what they hold back of each product.
- `barred`: the nodes a spec's tolerations keep out of a node set, counted per cause (only the
  census's `refusing` nodes are asked).
- `most_of_type`: the most GPUs of one type any node has (the largest TP a fix may suggest), from
  the census.
- `groups_bound`: an upper bound on how many GPU groups with a given room the cluster has,
  from the sorted indices (a few bisections), so that a spec asking for more replicas than that
  is refused before any search (docs/placement.md, "Bounded work per review").
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement.inputs import refusal
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.taints import tolerations_of
from vllmfit.core.spec.api import VLLMDeploymentSpec


@dataclass
class NodesOfSet:
    """The nodes of a set (None: all) for a group of `gpus` GPUs, by what their causes depend on.

    single[t][c]: how many nodes have only GPU type t (c of them); the cause of such a node
    depends on t, c and the spec, and its room on the ledger's indices. mixed: nodes with
    several types (MIG slices beside whole GPUs, mixed products): answered node by node.
    errors[text]: nodes whose budget policy is invalid. nogpu: nodes without a usable GPU.
    """

    single: dict[GpuType, dict[int, int]] = field(default_factory=dict)
    mixed: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    nogpu: int = 0
    members: frozenset[str] | None = None  # the set's nodes (None: every node)
    apart: set[str] = field(default_factory=set)  # its nodes not counted in `single` (mixed, errors)

    def only(self, name: str) -> bool:
        """Whether `name`, a node of an index of type t, is one of `single[t]` (its one type is t)."""
        return name not in self.apart and (self.members is None or name in self.members)


def nodes_of_set(ledger: Ledger, matching: NodeSet | None, gpus: int) -> NodesOfSet:
    """`NodesOfSet` of `matching` (None: every node) for groups of `gpus` GPUs (MIG slices count
    for one GPU only, as placement uses them). Cached until a node changes; building it reads one
    value each node computed once (NodeInfo.one_type)."""
    multi = gpus > 1
    return ledger.remembered(("summary", matching, multi),  # type: ignore[no-any-return]
                             lambda: _nodes_of_set(ledger, matching, multi))


def _nodes_of_set(ledger: Ledger, matching: NodeSet | None, multi: bool) -> NodesOfSet:
    out = NodesOfSet(members=None if matching is None else matching.members)
    if matching is None:  # every node: from the ledger's census, kept as nodes change (no walk)
        for k, count in sorted(ledger.census.of(multi).items(), key=_census_order):
            if k[0] == "single":
                out.single.setdefault(k[2], {})[k[3]] = count  # type: ignore[index]
            elif k[0] == "mixed":
                out.mixed.append(k[2])  # type: ignore[arg-type]
                out.apart.add(k[2])  # type: ignore[arg-type]
            elif k[0] == "error":
                out.errors[k[3]] = out.errors.get(k[3], 0) + 1  # type: ignore[call-overload,index]
                out.apart.add(k[2])  # type: ignore[arg-type]
            else:
                out.nogpu = count
        return out
    pairs: dict[tuple[GpuType, int], int] = {}
    nodes = ledger.nodes
    for name in matching.names:
        node = nodes[name]
        if node.error:
            out.errors[node.error] = out.errors.get(node.error, 0) + 1
            out.apart.add(name)
            continue
        one = node.one_type(multi)
        if one is None:
            out.nogpu += 1
        elif one is False:
            out.mixed.append(name)
            out.apart.add(name)
        else:
            pairs[one] = pairs.get(one, 0) + 1  # type: ignore[index]
    for (t, c), count in pairs.items():
        out.single.setdefault(t, {})[c] = count
    return out


def _census_order(e: tuple[tuple[object, ...], int]) -> tuple[str, ...]:
    k = e[0]
    return (str(k[0]), k[2].product if k[0] == "single" else str(k[2:]), str(k[3:]))  # type: ignore[attr-defined]


def policy_line(ledger: Ledger, matching: NodeSet | None) -> str:
    """The budget policies of the nodes of `matching` (None: all) that have a valid one, and what
    they hold back of each GPU product: 'budget policy (default) 0.9 x capacity - 2.0 GiB holds
    back 9.9 GiB of each NVIDIA-H100-80GB-HBM3'. Cached until a node changes."""
    return ledger.remembered(("policy", matching), lambda: _policy_line(  # type: ignore[no-any-return]
        ledger, (n for n in (ledger.nodes if matching is None else matching.names) if not ledger.nodes[n].error)))


def _policy_line(ledger: Ledger, names: Iterable[str]) -> str:
    held: dict[tuple[str, str], dict[str, str]] = {}
    for name in names:
        for src, rule, product, h in ledger.nodes[name].held_back:
            held.setdefault((src, rule), {})[product] = h
    return "; ".join(
        f"budget policy ({src}) {rule} holds back "
        + ", ".join(f"{h} of each {p}" for p, h in sorted(per.items()))
        for (src, rule), per in sorted(held.items())
    )


def barred(ledger: Ledger, matching: NodeSet, spec: VLLMDeploymentSpec) -> tuple[dict[str, int], int]:
    """The nodes outside `matching`: ({a cordon's or taint's words: nodes}, how many others, those
    a selector or affinity excludes). Cached per tolerations until a node changes."""
    def build() -> tuple[dict[str, int], int]:
        why, _ = count_barred(ledger, ledger.census.refusing, matching.members, spec)  # only these may refuse
        return why, len(ledger.nodes) - len(matching.members) - sum(why.values())

    return ledger.remembered(("barred", matching, tolerations_of(spec)), build)  # type: ignore[no-any-return]


def count_barred(ledger: Ledger, names: Iterable[str], allowed: Collection[str],
                 spec: VLLMDeploymentSpec) -> tuple[dict[str, int], int]:
    """Of the nodes `names` not in `allowed`: ({why the spec's pods may not go there (a cordon, a
    taint): nodes}, how many others)."""
    why: dict[str, int] = {}
    outside = 0
    for name in names:
        if name not in allowed:
            outside += 1
            if (w := refusal(ledger.nodes[name], spec)) is not None:
                why[w] = why.get(w, 0) + 1
    return why, outside - sum(why.values())


def most_of_type(ledger: Ledger, t: GpuType) -> int:
    """The most whole GPUs of type t one node has (at least 1), as the ledger counts them."""
    return ledger.most_of_one_type(t) or 1


UNBOUNDED = 1 << 62
"""groups_bound of a need of nothing."""


def groups_bound(ledger: Ledger, t: GpuType, gpus: int, need: int) -> int:
    """At most how many groups of `gpus` GPUs of type t (on one node each) needing `need` bytes on
    every GPU the cluster has room for now. Replicas share GPUs, so a GPU with headroom h holds at
    most h // need of them, never more than the roomiest GPU's; the GPUs with room for one
    (a bisection of the headroom index's distinct values, then a sum over those above: about 100
    per product at fleet size) hold at most that many each. A group takes one
    such place on each of its GPUs, on one node: for several GPUs, no more than the nodes whose
    group index says they hold one, times what the largest node of the type holds. Placing
    replicas one after the other only uses room up, so no search places more (tested)."""
    free = ledger.free_index(t)
    if need <= 0:
        return UNBOUNDED
    top = free.top()
    if top is None or top < need:
        return 0
    each = top // need  # places for one replica on the roomiest GPU
    places = free.count_from(need) * each
    if gpus == 1:
        return places
    nodes = ledger.group_index(t, gpus).count_from(need)
    return min(places // gpus, nodes * (most_of_type(ledger, t) * each // gpus))
