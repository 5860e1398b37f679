"""Fixtures for the operator tests: a KMock Kubernetes emulator and the real operator on it
(see opkit.py and shared/testing.md section 2)."""

from __future__ import annotations

from typing import Any

import kmock
import pytest
from opkit import VD, Cluster, Emulator, Operator

from vllmfit.core.spec import api


@pytest.fixture
async def km() -> Any:
    async with Emulator() as km, kmock.Server(km):
        km.resources.load_bundled()
        km.resources[VD] = kmock.ResourceInfo(
            kind=api.KIND, namespaced=True, singular=api.SINGULAR, shortnames=set(api.SHORT_NAMES),
            subresources={"status"}, verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
        for plural, kind, namespaced in (("resourceslices", "ResourceSlice", False),  # DRA (resource.k8s.io/v1)
                                         ("resourceclaims", "ResourceClaim", True),
                                         ("resourceclaimtemplates", "ResourceClaimTemplate", True)):
            km.resources[f"resource.k8s.io/v1/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, subresources={"status"} if plural == "resourceclaims" else set(),
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
        yield km


@pytest.fixture
async def cluster(km: Any) -> Any:
    c = Cluster(km)
    yield c
    await c.api.close()


@pytest.fixture
async def operator(km: Any) -> Any:
    op = Operator(km)
    await op.start()
    yield op
    await op.stop()


