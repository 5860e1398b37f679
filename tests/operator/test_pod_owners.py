"""The pod UID look-ups a node's report makes (issue 32): `Cache.managed_pods` answers from an
index checked against the records, where it was a pass over every record per report. Whatever the
order of pod events, status writes, records read back (a fail-over's adoption, a resync) and
records forgotten, it answers what a pass over every record answers (the code it replaced)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from vllmfit.operator.booking.record import Record
from vllmfit.operator.booking.state import Cache

KEYS = ["default/a", "default/b", "team/c"]
PODS = ["p0", "p1", "p2"]
UIDS = [f"{k}/{p}/{n}" for k in KEYS for p in PODS for n in range(2)]
"""A pod's UID is the API server's, one per pod: each key's pods have their own (a new pod of
the same name, a new UID)."""


def every_record(cache: Cache) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The maps as the passes over every record made them (managed_pods, attribute's `uids`,
    measured.replica_pods before issue 32)."""
    managed: dict[str, str] = {}
    for rec in cache.records.values():
        for uid in [*((rec.written or {}).get("podUids") or []), *rec.pod_uids.values()]:
            managed[str(uid)] = rec.key
    uids = {uid: rec.key for rec in cache.records.values() for uid in rec.pod_uids.values()}
    replicas = {uid: f"{rec.key}#{rec.pods[pod][0]}" for rec in cache.records.values()
                for pod, uid in rec.pod_uids.items() if pod in rec.pods}
    return managed, uids, replicas


def record(key: str, written: list[str]) -> Record:
    return Record(key, {"metadata": {"name": key.split("/")[1], "namespace": key.split("/")[0]}}, ("", key), 1,
                  written={"podUids": written} if written else {})


OPS = st.one_of(
    st.tuples(st.just("seen"), st.sampled_from(KEYS), st.sampled_from(PODS), st.integers(0, 1), st.integers(0, 2)),
    st.tuples(st.just("gone"), st.sampled_from(KEYS), st.sampled_from(PODS)),
    st.tuples(st.just("write"), st.sampled_from(KEYS)),  # the status writer: what the pods have
    st.tuples(st.just("adopt"), st.sampled_from(KEYS), st.lists(st.tuples(st.sampled_from(PODS), st.integers(0, 1)),
                                                                max_size=2)),
    st.tuples(st.just("resync"), st.sampled_from(KEYS), st.lists(st.tuples(st.sampled_from(PODS), st.integers(0, 1)),
                                                                 max_size=2)),
    st.tuples(st.just("forget"), st.sampled_from(KEYS)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=40))
def test_the_pod_owners_answer_as_a_pass_over_every_record(ops: list[tuple[Any, ...]]) -> None:
    cache = Cache()
    for op, key, *rest in ops:
        rec = cache.records.get(key)
        if op == "seen":
            pod, n, replica = rest
            uid = f"{key}/{pod}/{n}"
            rec = rec or cache.records.setdefault(key, record(key, []))
            rec.pods[pod] = (replica, None)  # type: ignore[assignment]
            cache.pod_seen(rec, pod, uid)
        elif op == "gone" and rec is not None:
            rec.pods.pop(rest[0], None)
            rec.pod_uids.pop(rest[0], None)
        elif op == "write" and rec is not None:
            rec.written = {"podUids": sorted(set(rec.pod_uids.values()))}
        elif op == "adopt":  # Store.adopt: a new record from a peer's status, indexed alone
            cache.records[key] = new = record(key, [f"{key}/{p}/{n}" for p, n in rest[0]])
            cache.index_records([new])
        elif op == "resync":  # Store.resync and rebuild: records read back, the index made anew
            cache.records = {**cache.records, key: record(key, [f"{key}/{p}/{n}" for p, n in rest[0]])}
            cache.index_records()
        elif op == "forget":
            cache.records.pop(key, None)
        managed, uids, replicas = every_record(cache)
        assert dict(cache.managed_pods()) == managed
        assert dict(cache.managed_pods(written=False)) == uids
        assert dict(cache.managed_pods(replica=True)) == replicas
        for uid in UIDS:  # the look-up the attribution makes
            assert cache.managed_pods().get(uid) == managed.get(uid)
