"""One writer in fact: every change of the ledger is a transaction of `Books` that commits all of
it or none of it, and no production code changes the ledger any other way.

- A change that raises halfway (a node update whose selection step fails, as it did when a review
  thread inserted into the selection cache the writer walked) rolls back: the writer's ledger and
  the committed snapshot are what they were, nothing is published, and a retry counts the node once.
- The writer's ledger cannot be changed outside a transaction through `Books.writing`.
- A scan of the operator's source (AST, not grep) finds every ledger change outside the writer:
  a mutator called on anything but the transaction's ledger, a ledger swapped in by assignment,
  the lock taken or a snapshot published by hand, the writer's ledger handed to a function that
  changes what it is given. The scan is shown to catch each of these in planted code.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest
from opkit import node

from vllmfit.core import placement
from vllmfit.core.placement import census
from vllmfit.operator.booking.state import Store
from vllmfit.sources import catalog

ROOT = pathlib.Path(__file__).resolve().parents[2] / "operator" / "vllmfit" / "operator"
WRITER = ROOT / "booking" / "books.py"
MUTATORS = {"set_node", "remove_node", "book", "restore", "release", "add_bookings"}
CHANGES_WHAT_IT_IS_GIVEN = {"hold", "revive", "charge", "carry", "apply", "correct", "recharge", "put_node",
                            "overlay_dra", "replan"}  # functions that change the ledger passed to them


def _info(name: str, gpus: int, **labels: str) -> placement.NodeInfo:
    body = node(name, gpus)
    body["metadata"]["labels"].update(labels)
    return placement.node_from_object(body, catalog.gpu_for_label)


def _free(ledger: placement.Ledger) -> list[tuple[str, int]]:
    return sorted((e[1], e[2]) for t in ledger.gpu_types() for e in ledger.free_index(t).below(1 << 62))


async def test_a_change_that_raises_halfway_is_rolled_back_and_publishes_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store()
    store.rebuild([node("gpu-a", 8), node("gpu-b", 8)], [])
    assert store.books.ledger.matching({"pool": "x"}) is not None  # a cached selection: set_node walks it
    committed, version, free = store.books.committed, store.books.version, _free(store.books.ledger)

    def fails(*args: object, **kwargs: object) -> object:
        raise RuntimeError("dictionary changed size during iteration")  # what the race raised there

    monkeypatch.setattr(placement.ledger, "still_matching", fails)
    with pytest.raises(RuntimeError):
        async with store.books.changing():
            store.books.ledger.set_node(_info("gpu-a", 8, pool="x"))  # unindexes gpu-a first, then fails
    assert store.books.committed is committed and store.books.version == version  # nothing published
    assert _free(store.books.ledger) == free == _free(store.books.committed)  # gpu-a's 8 GPUs still placeable
    monkeypatch.setattr(placement.ledger, "still_matching", census.still_matching)
    async with store.books.changing():  # the retry
        store.books.ledger.set_node(_info("gpu-a", 8, pool="x"))
    rebuilt = placement.Ledger(store.books.ledger.nodes.values())
    assert store.books.committed.census.classes == rebuilt.census.classes  # gpu-a counted once, not twice out
    assert _free(store.books.committed) == _free(rebuilt) and store.books.version == version + 1
    assert store.books.committed.matching({"pool": "x"}).names == ("gpu-a",)


async def test_a_transaction_that_changes_nothing_publishes_nothing() -> None:
    store = Store()
    store.rebuild([node("gpu-a", 1)], [])
    committed, version, changes = store.books.committed, store.books.version, store.books.changes
    async with store.books.transaction(counted=False) as ledger:
        assert ledger.nodes.keys() == {"gpu-a"}
    assert store.books.committed is committed and store.books.version == version and store.books.changes == changes


async def test_another_task_never_reads_a_transaction_half_done() -> None:
    """A handler's transaction awaits a decision in a worker thread halfway through its change;
    the loop's other tasks (the reservation pass, another handler's reads) run meanwhile."""
    import asyncio

    store = Store()
    store.rebuild([node("gpu-a", 1), node("gpu-b", 1)], [])
    halfway, go_on = asyncio.Event(), asyncio.Event()

    async def handler() -> None:
        async with store.books.transaction() as ledger:
            ledger.remove_node("gpu-a")
            assert list(store.books.ledger.nodes) == ["gpu-b"]  # its own change, seen by its own task
            halfway.set()
            await go_on.wait()

    task = asyncio.create_task(handler())
    await halfway.wait()
    assert sorted(store.books.ledger.nodes) == ["gpu-a", "gpu-b"]  # another task: the ledger before it
    with pytest.raises(RuntimeError):
        store.books.writing.release("k")  # and it cannot change the open transaction's ledger
    with pytest.raises(RuntimeError), store.books.step():
        pass
    go_on.set()
    await task
    assert sorted(store.books.ledger.nodes) == ["gpu-b"] == sorted(store.books.committed.nodes)


def test_the_writers_ledger_is_reached_for_change_only_inside_a_transaction() -> None:
    store = Store()
    with pytest.raises(RuntimeError, match="transaction"):
        store.books.writing.set_node(_info("gpu-a", 1))
    with pytest.raises(RuntimeError, match="transaction"):
        store.books.replace(placement.Ledger())
    with store.books.step() as ledger:
        assert store.books.writing is ledger
        ledger.set_node(_info("gpu-a", 1))
    assert list(store.books.committed.nodes) == ["gpu-a"]


# --- the scan ------------------------------------------------------------------------------------


def _bound_names(fn: ast.AST) -> set[str]:
    """Names a function may change the ledger through: its parameters, what `with ... as x`
    binds, and names assigned from `X.writing`, `X.fork()` or `Ledger(...)` (built apart)."""
    out: set[str] = set()
    if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        a = fn.args
        out |= {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
    for n in ast.walk(fn):
        if isinstance(n, ast.withitem) and isinstance(n.optional_vars, ast.Name):
            out.add(n.optional_vars.id)
        if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None and _apart(n.value):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                out |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}
    return out


def _apart(v: ast.expr) -> bool:
    if isinstance(v, ast.Tuple):
        return all(_apart(e) for e in v.elts) or any(_writing(e) for e in v.elts)
    if isinstance(v, ast.Call):
        f = v.func
        return (isinstance(f, ast.Attribute) and f.attr in ("fork", "correct")) or (
            isinstance(f, ast.Name) and f.id == "Ledger")
    return _writing(v)


def _writing(v: ast.expr) -> bool:
    return isinstance(v, ast.Attribute) and v.attr == "writing"


def _books_ledger(v: ast.expr) -> bool:
    return isinstance(v, ast.Attribute) and v.attr == "ledger" and (
        (isinstance(v.value, ast.Attribute) and v.value.attr == "books") or
        (isinstance(v.value, ast.Name) and v.value.id == "books"))


def violations(source: str, where: str) -> list[str]:
    """Every change of the ledger in `source` that does not go through the writer."""
    tree, out = ast.parse(source), []

    def visit(n: ast.AST, bound: set[str]) -> None:
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            bound = bound | _bound_names(n)
        line = f"{where}:{getattr(n, 'lineno', '?')}"
        if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Attribute) and t.attr == "ledger":
                    out.append(f"{line}: swaps the ledger (Books.replace inside a transaction)")
        if isinstance(n, ast.Attribute) and n.attr == "lock" and isinstance(n.value, ast.Attribute | ast.Name) and (
                getattr(n.value, "attr", None) == "books" or getattr(n.value, "id", None) == "books"):
            out.append(f"{line}: takes the books' lock (Books.transaction)")
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            recv, name = n.func.value, n.func.attr
            if name == "publish":
                out.append(f"{line}: publishes by hand (a transaction's commit publishes)")
            if name in MUTATORS and not (_writing(recv) or (isinstance(recv, ast.Name) and recv.id in bound)):
                out.append(f"{line}: {ast.unparse(recv)}.{name}() outside the transaction's ledger")
        if isinstance(n, ast.Call):
            fname = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if fname in CHANGES_WHAT_IT_IS_GIVEN and any(_books_ledger(a) for a in n.args):
                out.append(f"{line}: hands the writer's ledger to {fname}() (pass Books.writing)")
        for child in ast.iter_child_nodes(n):
            visit(child, bound)

    visit(tree, set())
    return out


def test_no_production_code_changes_the_ledger_outside_the_writer() -> None:
    found = [v for p in sorted(ROOT.rglob("*.py")) if p != WRITER
             for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("code", [
    "def f(store): store.books.ledger.release('k')",
    "def f(store):\n    ledger = store.books.ledger\n    ledger.set_node(x)",
    "def f(store): store.books.ledger = other",
    "async def f(store):\n    async with store.books.lock:\n        pass",
    "def f(store): store.books.publish()",
    "def f(store): draining.hold(store.books.ledger, d, k, [])",
    "def f(store): placement.replan(store.books.ledger, known)",
])
def test_the_scan_catches_each_way_around_the_writer(code: str) -> None:
    assert violations(textwrap.dedent(code), "planted")


@pytest.mark.parametrize("code", [
    "def f(store): store.books.writing.release('k')",
    "async def f(store):\n    async with store.books.transaction() as ledger:\n        ledger.remove_node('n')",
    "def f(ledger, key): ledger.release(key)",
    "def f(store):\n    work = store.books.ledger.fork()\n    work.release('k')",
    "def f(store): draining.hold(store.books.writing, d, k, [])",
    "def f(store): builders.gpus_of(store.books.ledger, 'k')",
])
def test_the_scan_lets_the_writers_own_ways_through(code: str) -> None:
    assert violations(textwrap.dedent(code), "planted") == []
