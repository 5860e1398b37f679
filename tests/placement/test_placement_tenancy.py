"""A refusal never names another tenant's deployment (issue 14, security): the webhook, conditions,
Events and the CLI show decide's message, reasons and suggestions, so none of them may carry the
namespace or name of what already holds the GPUs."""

from __future__ import annotations

from placement_fakes import H100, LLAMA_8B, node, request

from vllmfit.core import placement

SECRET = "team-secret"


def test_refusals_and_fixes_do_not_name_neighbours() -> None:
    ledger = placement.Ledger([node("gpu-a", H100, 1), node("gpu-b", H100, 1, labels={"pool": "b"})])
    for i, where in enumerate(("gpu-a", "gpu-b")):
        neighbour = request(f"{SECRET}/confidential-{i}", model=LLAMA_8B, placement={"nodeName": where},
                            maxModelLen=131072, kvCache={"concurrency": 2})
        d = placement.decide(ledger, neighbour)
        assert d.admitted, d.message
        ledger.book(d)
    mine = request("mine", maxModelLen=131072, kvCache={"concurrency": 8}, placement={"nodeName": "gpu-a"})
    d = placement.decide(ledger, mine)
    assert not d.admitted
    text = " ".join((d.message, *d.reasons, *d.suggestions))
    assert "gpu-a" in text  # the refusal does explain itself per node ...
    assert SECRET not in text and "confidential" not in text  # ... without naming who holds the GPU
