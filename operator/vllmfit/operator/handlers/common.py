"""Shared by every handler module: the Effects a step collects under the lock, parsing a
VLLMDeployment, deleting what may already be gone. (The clock and posting Events are
booking.report's `now` and `post_event`, which the binding room shares.)"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiException

from vllmfit.core.spec import api, read, validate
from vllmfit.operator.booking import models
from vllmfit.sources import catalog

logger = logging.getLogger(__name__)


RESOURCE = (api.GROUP, api.VERSION, api.PLURAL)


JSON_PATCH = "application/json-patch+json"


MERGE_PATCH = "application/merge-patch+json"


SETTLING = ("Starting", "Pending", "Terminating", "NotAdmitted", "ScaledToZero")


def store_of(memo: kopf.Memo) -> Any:
    """The operator's state (booking.state.Store), handed to every handler through Kopf's memo:
    operator.main (or a test) builds it once and puts it in the operator's memo as `store`, and
    Kopf gives each handler that memo (a resource's memo is a shallow copy of it)."""
    return memo["store"]


Invalid = read.SpecError
"""The object cannot be used as it is (message: one line naming the field): the one reader's error."""


@dataclass
class Effects:
    """What to do after the lock is released."""

    events: list[tuple[dict[str, Any], str, str, str]] = field(default_factory=list)  # body, type, reason, message
    sync: set[str] = field(default_factory=set)  # keys whose Deployments/Service to write or delete
    mark: set[str] = field(default_factory=set)  # keys whose status to write


def parse(body: Mapping[str, Any], policy: validate.Policy = validate.DEFAULT_POLICY,
          sources: validate.Sources | None = None) -> api.VLLMDeployment:
    """The object by the one reader and validator (vllmfit.core.spec.read), without reading the
    cluster (`sources` given, or none). Raises Invalid."""
    obj = read.deployment(body)
    return read.checked(obj, catalog_model=catalog.knows(obj.spec.model), policy=policy, sources=sources)


async def checked(store: Any, body: Mapping[str, Any]) -> api.VLLMDeployment:
    """The object by the one reader and validator, with the operator's tenancy policy and the envFrom
    ConfigMaps read from the cluster (models.checked, as the webhook calls it). Raises Invalid."""
    return await models.checked(store.api, body, store.options.tenancy)


async def gone_ok(delete: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Call a `delete_namespaced_*` API method; an object that is already gone (404) is fine."""
    try:
        await delete(*args)
    except ApiException as e:
        if e.status != 404:
            raise
