"""Shared by every handler module: the Effects a step collects under the lock, parsing a
VLLMDeployment, posting Events, the clock, deleting what may already be gone."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
import pydantic
from kubernetes_asyncio.client import ApiException

from vllmfit.core import errors
from vllmfit.core.spec import api, validate
from vllmfit.operator.booking import models
from vllmfit.operator.rendering import builders

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


class Invalid(ValueError):
    """The object cannot be used as it is (message: one line naming the field)."""


@dataclass
class Effects:
    """What to do after the lock is released."""

    events: list[tuple[dict[str, Any], str, str, str]] = field(default_factory=list)  # body, type, reason, message
    sync: set[str] = field(default_factory=set)  # keys whose Deployments/Service to write or delete
    mark: set[str] = field(default_factory=set)  # keys whose status to write


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse(body: Mapping[str, Any], policy: validate.Policy = validate.DEFAULT_POLICY,
          sources: validate.Sources | None = None) -> api.VLLMDeployment:
    """The object, checked by the one validator (builders.spec_problems). Raises Invalid."""
    return _checked(_object(body), policy, sources)


def _object(body: Mapping[str, Any]) -> api.VLLMDeployment:
    try:
        return api.VLLMDeployment.model_validate({"metadata": body.get("metadata") or {}, "spec": body.get("spec") or {}})
    except pydantic.ValidationError as e:
        raise Invalid(errors.one_line(e)) from None


def _checked(obj: api.VLLMDeployment, policy: validate.Policy, sources: validate.Sources | None) -> api.VLLMDeployment:
    problems = builders.spec_problems(obj, policy, sources)
    if problems:
        raise Invalid("; ".join(problems))
    return obj


async def checked(store: Any, body: Mapping[str, Any]) -> api.VLLMDeployment:
    """`parse` with the operator's tenancy policy and the envFrom ConfigMaps read from the cluster
    (models.env_sources). Raises Invalid."""
    obj = _object(body)  # validated once, then checked with the sources it names
    needed = validate.sources_needed(obj.spec)
    return _checked(obj, store.options.tenancy, await models.env_sources(store.api, obj) if needed else None)


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    try:
        kopf.event(dict(body), type=type_, reason=reason, message=message[:1000])  # type: ignore[arg-type]
    except LookupError:  # not inside a running operator (handler logic called directly)
        logger.info("event %s %s: %s", type_, reason, message)


async def gone_ok(delete: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Call a `delete_namespaced_*` API method; an object that is already gone (404) is fine."""
    try:
        await delete(*args)
    except ApiException as e:
        if e.status != 404:
            raise
