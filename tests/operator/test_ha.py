"""HA (issue 22): a standby that becomes the leader lists the cluster, catches up with what the
old leader decided, and sweeps what no booking covers, before it admits anything new.

KMock runs one operator; a standby is played by the same process: it stops leading and forgets
what the old leader decided after it last looked (its records and bookings), and the old leader
leaves a Deployment behind that no booking covers (it died between two writes)."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client
from opkit import DEPLOYMENTS, Cluster, Operator, node, vd

from vllmfit.operator.rendering import builders

# The real clock, for now (issue 29): on the virtual clock (looptime) the forged-status test failed
# 2 runs of 3 (f never decided again within the guard) and passed 3 of 3 on the real clock; why
# is not understood yet, so this module keeps the machine's clock until it is.

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
BIG = {"maxModelLen": 32768, "kvCache": {"concurrency": 16}}  # more than half of an H100's budget


def _index(requests: list[Any], method: str, path: str) -> list[int]:
    return [i for i, r in enumerate(requests) if str(r.method).upper().endswith(method) and path in str(r.url)]


async def test_a_new_leader_catches_up_and_sweeps_before_it_admits(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7, **BIG))
    await cluster.phase("a", "Admitted")
    a0 = await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"), what="a-0 written")
    store = cluster.store
    orphan = dict(a0)  # the old leader died after writing this Deployment, before its status
    orphan["metadata"] = {**a0["metadata"], "name": "old-0", "uid": "orphan",
                          "labels": {**a0["metadata"]["labels"], builders.LABEL_DEPLOYMENT: "old"}}
    # written before the standby stops leading: any event in between (an echo of a's writes)
    # takes the lead and sweeps, and a sweep before the orphan exists finds nothing to sweep
    # (the test's own race, seen twice in CI: "timed out waiting for old-0 swept")
    await client.AppsV1Api(cluster.api).create_namespaced_deployment("default", orphan)
    async with store.books.transaction(counted=False):  # a standby: not leading, and it never saw the old leader admit a
        store.leading = False
        store.cache.records.pop("default/a")
        store.books.ledger.release("default/a")
    assert not store.books.ledger.bookings_of("default/a")
    n = len(cluster.km.journal)
    await cluster.create(vd("b", QWEN7, **BIG))  # the first event the new leader handles
    await cluster.phase("b", "Unschedulable")  # caught up: a holds the only GPU
    assert store.leading
    assert [b.node for b in store.books.ledger.bookings_of("default/a")] == ["gpu-a"]
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "old-0") is None, what="old-0 swept")
    assert cluster.get(DEPLOYMENTS, "a-0") is not None
    later = list(cluster.km.journal)[n:]
    swept = _index(later, "DELETE", "/deployments/old-0")
    decided = _index(later, "PATCH", "/b/status")
    assert swept and decided and swept[0] < decided[0], (swept, decided)



async def test_a_new_leader_keeps_what_the_old_leader_admitted_after_its_last_look(
        cluster: Cluster, operator: Operator) -> None:
    """The catch-up of `lead()`. A standby's ledger is what it last read from the cluster (its
    start-up or its last resync, every --resync-seconds): here the cluster as it was before the
    old leader admitted a (built by the same `Store.rebuild` from that listing). The old leader
    admits a, writes its status and its Deployment, and dies. Kopf then replays every object to
    the new leader; the first is a itself.

    Neither other catch-up path covers this window: the resync loop runs every 30 s, and the event
    handler's adoption of a's status (`Store.adopt`) comes after `lead()` in the same handler, so
    without the listing in `lead()` its sweep finds a-0 covered by no booking and deletes a
    running vLLM server of an admitted deployment (then a is decided again, and a newcomer may get
    its GPU while its pod still runs)."""
    from vllmfit.core.spec import api
    from vllmfit.operator.handlers.sweep import list_cluster

    await cluster.create(node("gpu-a", gpus=1))
    store = cluster.store
    before_a = await list_cluster(store)  # the standby's last look: the node, no VLLMDeployment
    assert before_a[1] == []
    await cluster.create(vd("a", QWEN7, **BIG))  # the old leader admits a
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"), what="a-0 written")
    admitted = cluster.status("a")
    async with store.books.transaction(counted=False):  # the old leader dies; the standby never saw a
        store.rebuild(*before_a)
        store.leading = False
    assert not store.books.ledger.bookings_of("default/a") and "default/a" not in store.cache.records
    n = len(cluster.km.journal)
    # Kopf replays every object to the new leader: a first (an event about a), then a newcomer
    await cluster.custom.patch_namespaced_custom_object(
        api.GROUP, api.VERSION, "default", api.PLURAL, "a", {"metadata": {"labels": {"replayed": "yes"}}},
        _content_type="application/merge-patch+json")
    await cluster.until(lambda: store.leading, what="the standby to take the lead")
    await cluster.create(vd("b", QWEN7, **BIG))
    await cluster.until(lambda: cluster.status("b").get("phase"), what="b decided")
    await store.writer.flush()
    later = list(cluster.km.journal)[n:]
    assert not _index(later, "DELETE", "/deployments/a-0"), \
        "the new leader deleted a-0, a running Deployment the old leader admitted"
    b = cluster.status("b")
    assert b.get("phase") == "Unschedulable", \
        f"b was {b.get('phase')} on {b.get('placement')}: the GPU the old leader gave a was handed out again"
    assert cluster.get(DEPLOYMENTS, "a-0") is not None
    assert cluster.status("a").get("placement") == admitted.get("placement")
    assert cluster.status("a").get("phase") == "Admitted"
    assert [bk.node for bk in store.books.ledger.bookings_of("default/a")] == ["gpu-a"]


async def test_a_forged_admitted_status_patched_in_while_the_operator_runs_books_nothing(
        km: Any, cluster: Cluster) -> None:
    """A status the operator did not write (after a restart or a fail-over every record is a
    peer's) is taken only when the Deployments it describes exist, are owned by the object and
    sit where it says, as at restart. A tenant's patched Admitted status books nothing: the
    deployment is decided again."""
    from vllmfit.core.spec import api

    op = Operator(km)
    await op.start()
    try:
        await cluster.create(node("gpu-a", gpus=1))
        await cluster.create(vd("a", QWEN7, **BIG))
        await cluster.phase("a", "Admitted")
        await cluster.create(vd("f", QWEN7, **BIG))
        await cluster.phase("f", "Unschedulable")
        forged = cluster.status("a")  # a's placement, memory and conditions: f has no Deployment there
    finally:
        await op.stop()
    await cluster.reconnect()
    op = Operator(km)
    await op.start()  # restored: no record is this process's own
    try:
        store = cluster.store
        await cluster.custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, "default", api.PLURAL, "f", {"status": forged},
            _content_type="application/merge-patch+json")
        await cluster.until(lambda: cluster.status("f").get("phase") == "Unschedulable"
                            and store.cache.records["default/f"].mine, what="f decided again")
        await store.writer.flush()
        assert not store.books.ledger.bookings_of("default/f")
        assert [b.node for b in store.books.ledger.bookings_of("default/a")] == ["gpu-a"]
        assert cluster.get(DEPLOYMENTS, "f-0") is None
        assert cluster.status("f").get("phase") == "Unschedulable"
    finally:
        await op.stop()
