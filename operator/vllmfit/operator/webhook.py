"""Admission webhooks for VLLMDeployment, served by the operator process (Kopf) over TLS.

- validate-vllmdeployment: parses the object with the pydantic API types and runs the same
  `placement.decide` as the operator and `vllmfit plan`, on the operator's live ledger, under the
  store's lock. It never books: only the operator books, so dry runs change nothing. Denials carry
  the decision's reasons (per GPU) and its checked fixes.
- default-vllmdeployment: writes every pydantic default of api.VLLMDeploymentSpec that the object
  leaves out (image, dtype, replicas, placement.allowReschedule...), so what is stored is explicit.
  It never writes computed flags.

The webhook is advisory: two objects admitted in the same instant may not both fit; the operator's
serialized allocation is authoritative (docs/webhook.md). The pure part (parse, defaults_patch,
is_shrink, check) has no Kopf in it; `register`/`setup`/`Server` are the thin shell.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import hashlib
import json
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, Union, get_args, get_origin

import aiohttp.web
import kopf
from pydantic import BaseModel, ValidationError

from vllmfit.core import api, defaults, placement
from vllmfit.core.errors import UserError
from vllmfit.core.placement import affinity
from vllmfit.operator import bounded, builders, certs

logger = logging.getLogger(__name__)

VALIDATE_ID = "validate-vllmdeployment"
MUTATE_ID = "default-vllmdeployment"
OPERATIONS: list[Literal["CREATE", "UPDATE"]] = ["CREATE", "UPDATE"]
NOT_READY = "ledger not ready; the operator will check"
BUSY = "ledger busy; the operator will check"
LOCK_TIMEOUT_S = 3.0  # the apiserver waits timeoutSeconds (5) for the whole review
MAX_MESSAGE = 2000
REASONS = {400: "BadRequest", 403: "Forbidden", 409: "Conflict", 422: "Invalid"}


class Store(Protocol):
    """What the webhook needs from vllmfit.operator.state.Store."""

    ledger: placement.Ledger
    lock: asyncio.Lock
    ready: asyncio.Event

    async def request_for(self, obj: api.VLLMDeployment) -> placement.Request: ...


# --- The pure part ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    message: str = ""
    warnings: tuple[str, ...] = ()
    code: int = 200  # for denials: 403 does not fit, 422 invalid spec, 400 anything else


class Invalid(ValueError):
    """A spec pydantic refuses; the message is one line naming the field."""


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_message(e: ValidationError) -> str:
    """One line: the first error's field path, what is wrong, what was given, and how many more."""
    errors = e.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "object"
    msg = f"{where}: {first['msg']}"
    if first["type"] != "missing" and "input" in first and not isinstance(first["input"], dict | list):
        msg += f" (got {_short(first['input'])})"
    if len(errors) > 1:
        others = ", ".join(".".join(str(p) for p in err["loc"]) for err in errors[1:4])
        msg += f"; {len(errors) - 1} more: {others}" + (", ..." if len(errors) > 4 else "")
    return msg


def parse(obj: Mapping[str, Any]) -> api.VLLMDeployment:
    """The object as the API types read it. Raises Invalid. A CREATE with generateName has no
    name yet; a placeholder stands in (the name only matters for the deployment's own bookings)."""
    raw = dict(obj)
    meta = raw.get("metadata")
    if isinstance(meta, Mapping) and not meta.get("name"):
        raw["metadata"] = {**meta, "name": f"{meta.get('generateName') or ''}(generated)"}
    try:
        return api.VLLMDeployment.model_validate(raw)
    except ValidationError as e:
        raise Invalid(validation_message(e)) from None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model class of a field annotation (`X`, `X | None`), if it is one."""
    candidates = get_args(annotation) if get_origin(annotation) in (Union, type(int | None)) else (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def defaults_patch(spec: Mapping[str, Any], model: type[BaseModel] = api.VLLMDeploymentSpec,
                   overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The merge patch that adds every default of `model` that `spec` leaves out, recursing into
    nested objects that are present. Defaults of None or [] mean "unset" and are not written.
    `overrides` replace top-level defaults (the operator's --default-image for `image`)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in spec:
            if field.is_required():
                continue
            value = (overrides or {}).get(key, field.get_default(call_default_factory=True))
            if isinstance(value, BaseModel):
                value = value.model_dump(mode="json", by_alias=True, exclude_none=True)
            if value not in (None, [], {}):
                out[key] = value
        elif (sub := _model_of(field.annotation)) is not None and isinstance(spec[key], Mapping):
            inner = defaults_patch(spec[key], sub)
            if inner:
                out[key] = inner
    return out


NOT_MEMORY = frozenset({"env", "resources", "hf_token_secret_ref", "extra_args"})
"""Spec fields that change neither the memory a deployment needs nor where it may run."""
SMALLER_NEEDS_LESS = frozenset(
    {"replicas", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"})


def memory_changes(old: api.VLLMDeploymentSpec, new: api.VLLMDeploymentSpec) -> list[str]:
    """Fields whose change needs a new fit check (everything but env, resources, secrets, args,
    and a podTemplate change that leaves its required node affinity as it was)."""
    return [n for n in type(new).model_fields if n not in NOT_MEMORY and getattr(old, n) != getattr(new, n)
            and not (n == "pod_template" and _node_terms(old) == _node_terms(new))]


def _node_terms(spec: api.VLLMDeploymentSpec) -> object:
    try:
        return affinity.required_terms(spec)
    except ValueError as e:
        return str(e)


def is_shrink(old: api.VLLMDeploymentSpec, new: api.VLLMDeploymentSpec) -> bool:
    """True when `new` only lowers numbers that memory grows with (replicas, context, sequences,
    batched tokens, utilization, LoRA slots and rank), offloads more weights to CPU or turns
    enforceEager on: it cannot need more on any GPU."""
    changed = memory_changes(old, new)
    return bool(changed) and all(
        (n == "enforce_eager" and new.enforce_eager)
        or (n == "kv_cache" and _kv_shrink(old.kv_cache, new.kv_cache))
        or (n == "lora" and _lora_shrink(old.lora, new.lora))
        or (n == "cpu_offload" and new.cpu_offload_bytes > old.cpu_offload_bytes)
        or (n in SMALLER_NEEDS_LESS and getattr(old, n) is not None and getattr(new, n) is not None
            and getattr(new, n) < getattr(old, n))
        for n in changed
    )


def _lora_shrink(old: api.LoraSpec | None, new: api.LoraSpec | None) -> bool:
    """LoRA removed, or fewer slots / a lower rank in the same dtype."""
    if old is None:
        return False
    if new is None:
        return True
    return (new.lora_dtype == old.lora_dtype and new.max_loras <= old.max_loras
            and new.max_lora_rank <= old.max_lora_rank)


def _kv_shrink(old: api.KvCacheSpec | None, new: api.KvCacheSpec | None) -> bool:
    """The same kind of KV request, lowered (tokens, memory or concurrency; typicalLength and grow
    unchanged)."""
    if old is None or new is None:
        return False
    if (old.typical_length, old.grow) != (new.typical_length, new.grow) or new.grow:
        return False
    pairs = [(old.tokens, new.tokens), (old.memory_bytes, new.memory_bytes), (old.concurrency, new.concurrency)]
    if any((a is None) != (b is None) for a, b in pairs):
        return False
    return all(b <= a for a, b in pairs if a is not None and b is not None) and old != new


def _where(d: placement.Decision) -> str:
    return ", ".join(f"{r.node} GPU {list(r.gpus)}" for r in d.replicas)


def _elsewhere(ledger: placement.Ledger, req: placement.Request) -> str:
    """Where the request would fit if it were not pinned ('' if nowhere)."""
    free = req.spec.placement.model_copy(update={"node_name": None, "gpu_indices": None})
    d = placement.decide(ledger, replace(req, spec=req.spec.model_copy(update={"placement": free})), suggest=False)
    return _where(d) if d.admitted else ""


def check(ledger: placement.Ledger, req: placement.Request, *, old: api.VLLMDeploymentSpec | None = None,
          dry_run: bool = False, old_flags: api.Flags | None = None) -> Verdict:
    """The verdict for `req` on `ledger` (read only). `old`: the stored spec, on an UPDATE, and
    `old_flags` its status.flags. A change of spec.replicas alone (kubectl scale, an HPA) keeps the
    replicas it holds where they are, as the operator does: only new replicas must fit."""
    keep: list[placement.ReplicaAllocation] = []
    if old is not None and memory_changes(old, req.spec) == ["replicas"]:
        flags = builders.to_memory_flags(old_flags) if old_flags else None
        keep = placement.held_replicas(ledger, req.key, min(old.replicas, req.spec.replicas), flags)
    d = placement.decide(ledger, req, keep=keep)
    if d.admitted:
        extra: tuple[str, ...] = ()
        if dry_run:
            flags = " ".join(d.flags.args()) if d.flags else ""
            extra = (f"dry run: would be placed on {_where(d)} with {flags}; nothing was booked",)
        return Verdict(True, warnings=d.warnings + extra)
    if d.phase == "Rejected":
        return Verdict(False, "; ".join(d.reasons) or d.message, d.warnings, 422)
    if old is not None and is_shrink(old, req.spec):
        return Verdict(True, warnings=(*d.warnings, f"admitted because it needs less than before, but: {d.message}"))
    msg = d.message
    pin = req.spec.placement
    if pin.node_name and not pin.allow_reschedule and (where := _elsewhere(ledger, req)):
        msg += f". It fits on {where}: pin it there or set placement.allowReschedule: true"
    return Verdict(False, msg, d.warnings, 403)


# --- The Kopf shell -----------------------------------------------------------------------------


async def review(store: Store, body: Mapping[str, Any], old_body: Mapping[str, Any] | None,
                 operation: str, dry_run: bool) -> Verdict:
    """Validate one admission request against the live ledger. Never books."""
    unchanged = old_body is not None and body.get("spec") == old_body.get("spec")
    if operation == "UPDATE" and (unchanged or (body.get("metadata") or {}).get("deletionTimestamp")):
        return Verdict(True)  # metadata-only updates (finalizers, labels) are never re-checked
    obj = parse(body)
    problems = builders.spec_problems(obj)
    if not (body.get("metadata") or {}).get("name"):  # generateName: the API server makes a DNS label
        problems = [p for p in problems if p != builders.name_problem(obj.metadata.name)]
    if problems:
        raise Invalid("; ".join(problems))
    old = None
    if operation == "UPDATE" and old_body is not None:
        try:
            old = parse(old_body)
        except Invalid:
            old = None
        if old is not None and not memory_changes(old.spec, obj.spec):
            return Verdict(True)
    if not store.ready.is_set():
        return Verdict(True, warnings=(NOT_READY,))
    try:
        req = await store.request_for(obj)
    except Exception as e:  # noqa: BLE001 - record.ModelResolutionError, or anything its resolvers raise
        message = str(e) or f"cannot resolve model {obj.spec.model!r}"
        if getattr(e, "transient", False):  # Hub unreachable, ConfigMap not created yet: apply order
            return Verdict(True, warnings=(f"{message}; the operator will retry",))
        return Verdict(False, message, code=422)
    lock = store.lock
    try:
        async with asyncio.timeout(LOCK_TIMEOUT_S):
            await lock.acquire()
    except TimeoutError:
        return Verdict(True, warnings=(BUSY,))
    old_flags = old.status.flags if old is not None and old.status is not None else None
    # Off the event loop, with a time limit, on the live ledger (a copy per review would cost more
    # than the review: 6 ms on 8,000 GPUs). The lock keeps the ledger still while the worker reads it;
    # a worker past its limit keeps the lock until it ends (bounded by core.limits), and reviews
    # that cannot get the lock meanwhile are let through for the operator to check (BUSY).
    fut = asyncio.get_running_loop().run_in_executor(bounded.pool(), functools.partial(
        check, store.ledger, req, old=old.spec if old else None, dry_run=dry_run, old_flags=old_flags))
    try:
        async with asyncio.timeout(defaults.REVIEW_DECIDE_TIMEOUT_S):
            return await asyncio.shield(fut)
    except TimeoutError:
        bounded.abandoned += 1
        fut.add_done_callback(lambda f, held=lock: (held.release(), f.cancelled() or f.exception()))
        lock = None  # released by the worker's end, not here
        return Verdict(False, bounded.too_costly_message(defaults.REVIEW_DECIDE_TIMEOUT_S), code=422)
    finally:
        if lock is not None:
            lock.release()


def stored_object(store: Store, key: str) -> Mapping[str, Any] | None:
    """The VLLMDeployment `key` as the operator last saw it (its records), if it has one."""
    records = getattr(store, "records", None)
    rec = records.get(key) if isinstance(records, Mapping) else None
    body = getattr(rec, "body", None)
    return body if isinstance(body, Mapping) else None


async def review_scale(store: Store, scale: Mapping[str, Any], dry_run: bool) -> Verdict:
    """An UPDATE of vllmdeployments/NAME/scale (`kubectl scale`, a HorizontalPodAutoscaler): the
    request's object is an autoscaling/v1 Scale, so the stored VLLMDeployment with the new
    spec.replicas is reviewed like any other spec change: growing only if every new replica fits,
    shrinking always."""
    meta = scale.get("metadata") or {}
    key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
    replicas = (scale.get("spec") or {}).get("replicas")
    current = stored_object(store, key)
    if current is None or not isinstance(replicas, int) or isinstance(replicas, bool):
        return Verdict(True, warnings=(f"{key}: scale to {replicas}: not known yet; the operator will check",))
    new = {**current, "spec": {**(current.get("spec") or {}), "replicas": replicas}}
    return await review(store, new, current, "UPDATE", dry_run)


def clip(message: str) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def _default_store() -> Store:
    from vllmfit.operator import state

    return state.get_store()


def register(registry: kopf.OperatorRegistry | None = None, store: Store | None = None,
             default_image: str | None = None) -> None:
    """Register the two admission handlers (ids = URL paths) in `registry` (Kopf's default if None).
    `store=None` reads vllmfit.operator.state.get_store() on each request. `default_image`: the
    operator's --default-image, written by the mutating webhook instead of the pydantic default."""
    overrides = {"image": default_image} if default_image else {}

    @kopf.on.validate(api.GROUP, api.VERSION, api.PLURAL, id=VALIDATE_ID, operations=OPERATIONS,
                      subresource="*", registry=registry)
    async def validate_vllmdeployment(body: kopf.Body, dryrun: bool, warnings: list[str], old: kopf.Body | None = None,
                                      operation: str = "CREATE", subresource: str | None = None, **_: Any) -> None:
        try:
            if subresource == "scale":
                v = await review_scale(store or _default_store(), dict(body), dryrun)
            elif subresource is not None:  # status is the operator's: never reviewed
                return
            else:
                v = await review(store or _default_store(), dict(body), dict(old) if old is not None else None,
                                 operation, dryrun)
        except Invalid as e:
            raise kopf.AdmissionError(clip(str(e)), code=422) from None
        except Exception as e:
            logger.exception("validating webhook failed")
            raise kopf.AdmissionError(clip(f"vllmfit webhook error: {type(e).__name__}: {e}"), code=400) from None
        warnings.extend(clip(w) for w in v.warnings)
        if not v.allowed:
            raise kopf.AdmissionError(clip(v.message), code=v.code)

    @kopf.on.mutate(api.GROUP, api.VERSION, api.PLURAL, id=MUTATE_ID, operations=OPERATIONS, registry=registry)
    async def default_vllmdeployment(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        spec = body.get("spec")
        if isinstance(spec, Mapping):  # anything else is for the validating webhook to deny
            for key, value in defaults_patch(spec, overrides=overrides).items():
                patch.spec[key] = value


# --- The server ---------------------------------------------------------------------------------


def denial(data: Any, message: str, code: int = 400) -> dict[str, Any]:
    """A denied AdmissionReview v1 response (the uid copied when there is one)."""
    req = data.get("request") if isinstance(data, dict) else None
    uid = req.get("uid") if isinstance(req, dict) and isinstance(req.get("uid"), str) else ""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {
        "uid": uid, "allowed": False,
        "status": {"code": code, "reason": REASONS.get(code, "BadRequest"), "message": clip(message)}}}


def review_problem(data: Any) -> str | None:
    """What makes `data` not an AdmissionReview request Kopf can serve, or None."""
    req = data.get("request") if isinstance(data, dict) else None
    if not isinstance(req, dict):
        return "not an AdmissionReview: request is missing"
    for key, kind in (("uid", str), ("operation", str), ("resource", dict), ("userInfo", dict)):
        if not isinstance(req.get(key), kind):
            return f"request.{key} is missing or not a{'n object' if kind is dict else ' string'}"
    if not all(isinstance(req["resource"].get(k), str) for k in ("group", "version", "resource")):
        return "request.resource needs group, version and resource strings"
    obj, old = req.get("object"), req.get("oldObject")
    if not isinstance(obj, dict) and not isinstance(old, dict):
        return "request.object is missing or not an object"
    for key in ("object", "oldObject"):
        if req.get(key) is not None and not isinstance(req[key], dict):
            return f"request.{key} is not an object"
        if isinstance(req.get(key), dict) and not isinstance(req[key].get("metadata", {}), dict):
            return f"request.{key}.metadata is not an object"
    if not isinstance(req.get("dryRun", False), bool | None):
        return "request.dryRun is not a boolean"
    return None


def _finish(response: dict[str, Any]) -> dict[str, Any]:
    """Every denial gets a 4xx code, a reason (kubectl prints it) and a message."""
    r = response.get("response", {})
    if not r.get("allowed"):
        status = r.setdefault("status", {})
        code = status.get("code") or 403
        status["code"] = 400 if code >= 500 or code < 400 else code
        status.setdefault("reason", REASONS.get(status["code"], "BadRequest"))
        status["message"] = clip(status.get("message") or "denied by vllmfit without a reason")
    return response


def client_name_problem(peercert: Mapping[str, Any] | None, allowed: Collection[str]) -> str | None:
    """Why a verified client certificate is not one the webhook serves, or None: its subject CN or
    one of its DNS SANs must be in `allowed` (--webhook-client-name; empty: any name). `peercert`
    is what ssl.SSLSocket.getpeercert() returns."""
    if not allowed:
        return None
    if not peercert:
        return "no client certificate; --webhook-client-name needs --webhook-client-ca"
    cns = [v for rdn in peercert.get("subject", ()) for k, v in rdn if k == "commonName"]
    dns = [v for k, v in peercert.get("subjectAltName", ()) if k == "DNS"]
    if set(cns + dns) & set(allowed):
        return None
    names = " ".join(", ".join([f"CN={c}" for c in cns] + [f"DNS:{d}" for d in dns]).split()) or "no CN or DNS name"
    names = names if len(names) <= 200 else names[:197] + "..."
    return f"client certificate ({names}) is not an allowed API server name (--webhook-client-name)"


class _Connection(asyncio.Protocol):
    """One client connection from accept to close, in front of aiohttp's request handler. Kopf's
    server gives aiohttp a TLS listener with no limits on connections; this adds them:

    - a slot from accept, before any TLS work: beyond `server.max_connections` open connections a
      new one is closed at once (asyncio allocates a 256 KiB TLS buffer per connection, and each
      holds a file descriptor);
    - TLS must be up within `server.handshake_timeout` (asyncio's start_tls; its default is 60 s);
    - a request's line and headers must arrive within `server.header_timeout` of its first byte,
      or, for the first request, of TLS being up (aiohttp's only timer is the idle keep-alive);

    and the slot is released when the connection closes, whichever way."""

    def __init__(self, server: Server, make_handler: Callable[[], asyncio.Protocol], context: ssl.SSLContext | None):
        self.server, self.make_handler, self.context = server, make_handler, context
        self.transport: Any = None  # the TCP transport, then the TLS one
        self.handler: Any = None  # aiohttp's RequestHandler, once TLS is up
        self.deadline: asyncio.TimerHandle | None = None
        self.in_request = False
        self.closed = False
        self.early: list[bytes] = []  # what arrived between the handshake and _ready (one read at most)

    def connection_made(self, transport: Any) -> None:  # TCP accepted
        self.transport = transport
        if len(self.server.connections) >= self.server.max_connections:
            self.server.refused += 1
            self.closed = True
            transport.abort()
            return
        self.server.connections.add(self)
        if self.context is None:
            self._ready(transport)
            return
        transport.pause_reading()  # the ClientHello waits in the socket for start_tls
        asyncio.get_running_loop().create_task(self._handshake(transport))

    async def _handshake(self, tcp: Any) -> None:
        try:
            tls = await asyncio.get_running_loop().start_tls(
                tcp, self, self.context, server_side=True, ssl_handshake_timeout=self.server.handshake_timeout)
        except Exception as e:  # noqa: BLE001 - no or a refused client certificate, a timeout, a reset
            logger.debug("webhook TLS handshake failed: %s", e)
            # Its traceback holds start_tls's frame, whose waiter holds it: a cycle that would keep
            # the connection's 256 KiB TLS buffer until a full GC (measured: 4x the cap alive).
            e.__traceback__ = None
            self.close()
            return
        if tls is None or self.closed:  # the client left right after the handshake
            self.close()
            return
        self._ready(tls)

    def _ready(self, transport: Any) -> None:
        """TLS is up: aiohttp's handler takes the connection, and the first request is due."""
        self.transport = transport
        self.handler = self.make_handler()
        self.handler.connection_made(transport)
        self._arm()
        for data in self.early:
            self.data_received(data)
        self.early.clear()

    def _arm(self) -> None:
        self.deadline = asyncio.get_running_loop().call_later(self.server.header_timeout, self._expired)

    def _expired(self) -> None:
        self.deadline = None
        self.server.header_timeouts += 1
        self.close()

    def headers_complete(self) -> None:
        """A request reached the application (aiohttp parsed its line and headers)."""
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.in_request = True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._release()

    def _release(self) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    # asyncio.Protocol, forwarded to aiohttp once TLS is up
    def data_received(self, data: bytes) -> None:
        if self.handler is None:  # asyncio reads on as soon as TLS is up, before start_tls returns
            self.early.append(data)
            return
        if self.deadline is None and not self.in_request:  # the first bytes of the next request
            self._arm()
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self.handler is not None:
            self.handler.connection_lost(exc)


class Server(kopf.WebhookServer):
    """Kopf's aiohttp HTTPS server (its TLS context, URL and client-config helpers), with its own
    `__call__`: Kopf's starts an aiohttp TCPSite with no hook for connection limits, and watches
    the certificate files but not verify_cafile. What it adds:
    - `tls`, an async callable run when serving starts, returns (cafile, certfile, pkeyfile);
      it is retried with back-off, so a missing RBAC rule or a slow apiserver delays the webhook
      but never stops the operator;
    - a guard: a body that is not JSON gets HTTP 400, a malformed AdmissionReview or any exception
      a denied review with a message; unknown paths get 404. Never an HTTP 500.
    - limits (core/defaults.py WEBHOOK_*): a body over `max_body` bytes gets 413; a body not
      complete within `read_timeout` seconds gets 408 and the connection is closed; beyond
      `max_concurrent` requests in flight (reading or deciding) the next gets 429 at once;
      connections: see _Connection (a cap, a handshake and a header timeout) and `idle_timeout`;
    - client authentication (`client_ca`, Kopf's verify_cafile): the API server must present a
      certificate the CA signed (ssl.CERT_REQUIRED), else the handshake fails; with
      `client_names`, its CN or a DNS SAN must be one of them, else HTTP 403 before anything is
      read or routed.
    The certificate, key and CA files are re-read every `file_check_interval` seconds and the
    listener restarts when one changes (cert-manager renews in place; a ConfigMap changes in place).
    """

    def __init__(self, *, tls: Callable[[], Awaitable[tuple[Any, Any, Any]]] | None = None,
                 client_ca: str | os.PathLike[str] | None = None, client_names: Collection[str] = (),
                 max_body: int = defaults.WEBHOOK_MAX_BODY_BYTES,
                 read_timeout: float = defaults.WEBHOOK_READ_TIMEOUT_S,
                 max_concurrent: int = defaults.WEBHOOK_MAX_CONCURRENT,
                 max_connections: int = defaults.WEBHOOK_MAX_CONNECTIONS,
                 handshake_timeout: float = defaults.WEBHOOK_HANDSHAKE_TIMEOUT_S,
                 header_timeout: float = defaults.WEBHOOK_HEADER_TIMEOUT_S,
                 idle_timeout: float = defaults.WEBHOOK_IDLE_TIMEOUT_S, **kwargs: Any):
        if client_ca is not None:
            kwargs.update(verify_cafile=client_ca, verify_mode=ssl.CERT_REQUIRED)
        super().__init__(**kwargs)
        self.tls = tls
        self.client_names = tuple(client_names)
        self.max_body, self.read_timeout, self.max_concurrent = max_body, read_timeout, max_concurrent
        self.max_connections, self.handshake_timeout = max_connections, handshake_timeout
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        # only touched from the event loop:
        self.in_flight = 0
        self.connections: set[_Connection] = set()
        self.refused = self.header_timeouts = 0  # connections closed at accept / for slow headers

    async def __call__(self, fn: Any) -> Any:
        delay = 1.0
        while self.tls is not None:
            try:
                self.cafile, self.certfile, self.pkeyfile = await self.tls()
                break
            except Exception:
                logger.exception("webhook TLS setup failed; retrying in %.0f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)

        @aiohttp.web.middleware
        async def guard(request: aiohttp.web.Request, handler: Any) -> aiohttp.web.StreamResponse:
            return await self._guard(request, handler)

        async def serve(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await self._serve(fn, request)

        loop = asyncio.get_running_loop()
        cadata, context = await self._usable_ssl(wait_for_change=False)
        while True:
            app = aiohttp.web.Application(middlewares=[guard])
            app.add_routes([aiohttp.web.post(f"{(self.path or '').rstrip('/')}/{{id:.*}}", serve)])
            runner = aiohttp.web.AppRunner(app, handle_signals=False, keepalive_timeout=self.idle_timeout,
                                           max_headers=defaults.WEBHOOK_MAX_HEADERS)
            await runner.setup()
            try:
                port = self.port or self._allocate_free_port()
                listener = await loop.create_server(functools.partial(_Connection, self, runner.server, context),
                                                    self.addr or None, port, reuse_address=True, reuse_port=True)
                try:
                    yield self._client_config(cadata, context is not None, port)
                    cadata, context = await self._usable_ssl(wait_for_change=True)
                    logger.info("webhook TLS files changed; restarting the listener")
                finally:
                    listener.close()
                    for conn in list(self.connections):
                        conn.close()
            finally:
                await runner.cleanup()

    def _client_config(self, cadata: bytes | None, tls: bool, port: int) -> kopf.WebhookClientConfig:
        """What Kopf's own configuration manager would write (only used with settings.admission.managed)."""
        host = self.host or self.DEFAULT_HOST or self._get_accessible_addr(self.addr)
        config = kopf.WebhookClientConfig(url=self._build_url("https" if tls else "http", host, port, self.path or ""))
        if cadata is not None:
            config["caBundle"] = base64.b64encode(cadata).decode("ascii")
        return config

    def _files_digest(self) -> bytes:
        digest = hashlib.sha256()
        for path in (self.certfile, self.pkeyfile, self.cafile, self.verify_cafile):
            if path is not None:
                try:
                    digest.update(Path(path).read_bytes())
                except OSError:  # mid-rotation; the next look decides
                    digest.update(b"unreadable")
        return digest.digest()

    async def _usable_ssl(self, *, wait_for_change: bool) -> tuple[bytes | None, ssl.SSLContext | None]:
        """Kopf's TLS context from the files (`_build_ssl`: the certificate; with verify_cafile,
        ssl.CERT_REQUIRED and that CA only) and the CA bundle for the client config. With
        `wait_for_change`, first waits until one of the files changes. Files that make no context
        (half-written, a CA that is not PEM) are logged and looked at again every
        file_check_interval; meanwhile the listener keeps serving with the context it has."""
        seen = self._files_digest() if wait_for_change else None
        while True:
            if seen is None or self._files_digest() != seen:
                try:
                    return self._build_ssl()
                except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                    logger.error("webhook TLS files unusable: %s; looking again in %g s", e, self.file_check_interval)
                    seen = self._files_digest()
            await asyncio.sleep(self.file_check_interval)

    async def _guard(self, request: aiohttp.web.Request, handler: Any) -> aiohttp.web.StreamResponse:
        """Every request, once aiohttp has its line and headers: ends the connection's header
        deadline, and refuses a client certificate with a name not allowed (403, before routing)."""
        conn = request.transport.get_protocol() if request.transport is not None else None
        if isinstance(conn, _Connection):
            conn.headers_complete()
        try:
            if self.client_names:
                peer = request.transport.get_extra_info("peercert") if request.transport is not None else None
                problem = client_name_problem(peer, self.client_names)
                if problem:
                    logger.warning("webhook request refused: %s", problem)
                    return _closing(aiohttp.web.Response(status=403, text=problem))
            return await handler(request)
        finally:
            if isinstance(conn, _Connection):
                conn.in_request = False

    async def _serve(self, fn: Any, request: aiohttp.web.Request) -> aiohttp.web.Response:
        hook = request.match_info.get("id", "")
        if hook not in (VALIDATE_ID, MUTATE_ID):
            raise aiohttp.web.HTTPNotFound(text=f"no webhook at /{hook}; the paths are /{VALIDATE_ID}, /{MUTATE_ID}")
        if self.in_flight >= self.max_concurrent:
            return _closing(aiohttp.web.Response(
                status=429, text=f"more than {self.max_concurrent} admission reviews in flight; retry"))
        self.in_flight += 1
        try:
            return await self._limited(fn, request, hook)
        finally:
            self.in_flight -= 1

    async def _read(self, request: aiohttp.web.Request) -> bytes | aiohttp.web.Response:
        """The body, or the 413/408 response; never more than max_body bytes buffered."""
        too_big = _closing(aiohttp.web.Response(status=413, text=f"the body is over {self.max_body} bytes"))
        if (request.content_length or 0) > self.max_body:
            return too_big
        body = bytearray()
        try:
            async with asyncio.timeout(self.read_timeout):
                while chunk := await request.content.readany():
                    body += chunk
                    if len(body) > self.max_body:
                        return too_big
        except TimeoutError:
            return _closing(aiohttp.web.Response(
                status=408, text=f"the body was not complete within {self.read_timeout:g} s"))
        return bytes(body)

    async def _limited(self, fn: Any, request: aiohttp.web.Request, hook: str) -> aiohttp.web.Response:
        body = await self._read(request)
        if isinstance(body, aiohttp.web.Response):
            return body
        try:
            data = json.loads(body)
        except Exception as e:  # noqa: BLE001 - not UTF-8, not JSON, nested too deep
            return aiohttp.web.json_response(denial(None, f"the body is not JSON: {e}"), status=400)
        problem = review_problem(data)
        if problem:
            return aiohttp.web.json_response(denial(data, problem))
        req = data["request"]
        for key in ("object", "oldObject"):  # CREATE objects may lack the namespace; the review has it
            if isinstance(req.get(key), dict) and isinstance(req.get("namespace"), str):
                req[key].setdefault("metadata", {}).setdefault("namespace", req["namespace"])
        try:
            peer = request.transport.get_extra_info("peercert") if request.transport else None
            response = await fn(data, webhook=hook, sslpeer=peer, headers=dict(request.headers))
        except Exception as e:
            logger.exception("admission request failed")
            response = denial(data, f"vllmfit webhook error: {type(e).__name__}: {e}")
        return aiohttp.web.json_response(_finish(response))


def _closing(response: aiohttp.web.Response) -> aiohttp.web.Response:
    """The response, with the connection closed after it (the rest of the body is never read)."""
    response.force_close()
    return response


# --- Wiring -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The webhook's flags (the operator adds --namespace, which the Secret lives in)."""
    g = parser.add_argument_group("admission webhook")
    g.add_argument("--webhook-port", type=int, default=9443, help="HTTPS port (default 9443)")
    g.add_argument("--webhook-host", default="0.0.0.0", help="address to listen on (default all)")
    g.add_argument("--webhook-service", default="vllmfit-webhook",
                   help="the Service in front of the webhook (certificate names)")
    g.add_argument("--cert-secret", default="vllmfit-webhook-cert",
                   help="Secret keeping the generated CA and certificate (ca.crt, tls.crt, tls.key)")
    g.add_argument("--cert-dir", default=None,
                   help="serve tls.crt/tls.key (and ca.crt) from here, e.g. a cert-manager Secret mount; "
                        "no Secret is managed and no caBundle injected")
    g.add_argument("--validating-webhook", default="vllmfit-validate",
                   help="ValidatingWebhookConfiguration to put the CA into ('' for none)")
    g.add_argument("--mutating-webhook", default="vllmfit-default",
                   help="MutatingWebhookConfiguration to put the CA into ('' for none)")
    g.add_argument("--webhook-failure-policy", choices=["Fail", "Ignore"], default=None,
                   help="set failurePolicy of the validating webhooks when injecting the CA "
                        "(default: leave what the chart rendered)")
    g.add_argument("--webhook-client-ca", metavar="FILE", default=None,
                   help="PEM bundle of the CA(s) that sign the API server's webhook client certificate; when "
                        "set, clients must present a certificate it signed (docs/webhook.md, 'Client authentication')")
    g.add_argument("--webhook-client-name", metavar="NAME", action="append", default=[],
                   help="with --webhook-client-ca: the client certificate's CN or a DNS SAN must be one of these "
                        "(repeatable; default: any certificate the CA signed); other clients get HTTP 403")
    g.add_argument("--no-webhook", action="store_true", help="serve no admission webhooks")


def namespace_of(args: argparse.Namespace) -> str:
    """The operator's namespace: --namespace, else POD_NAMESPACE, else the service account's."""
    ns = getattr(args, "namespace", None)
    if isinstance(ns, list | tuple):
        ns = ns[0] if ns else None
    if not ns:
        ns = os.environ.get("POD_NAMESPACE")
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    if not ns and sa.exists():
        ns = sa.read_text().strip()
    return ns or "default"


async def prepare_tls(args: argparse.Namespace, kube: certs.Api | None = None) -> tuple[Path | None, Path, Path]:
    """(cafile, certfile, pkeyfile) for the server: cert-manager's files from --cert-dir, or a
    bundle from the --cert-secret Secret (created if absent) written to a temp dir, with its CA
    injected into the webhook configurations."""
    if args.cert_dir:
        d = Path(args.cert_dir)
        return (d / certs.CA_KEY if (d / certs.CA_KEY).exists() else None), d / certs.CERT_KEY, d / certs.PKEY_KEY
    kube = kube or certs.KubeApi()
    bundle = await certs.ensure(kube, namespace_of(args), args.cert_secret, args.webhook_service)
    paths = certs.write(bundle)
    if args.validating_webhook:
        await certs.inject_ca(kube, "validating", args.validating_webhook, bundle.ca_crt, args.webhook_failure_policy)
    if args.mutating_webhook:
        await certs.inject_ca(kube, "mutating", args.mutating_webhook, bundle.ca_crt)
    return paths


def client_auth(args: argparse.Namespace) -> dict[str, Any]:
    """--webhook-client-ca / --webhook-client-name as Server arguments. Checked before Kopf starts:
    a CA file that cannot be loaded, or names without a CA, is one line (UserError), not a webhook
    that refuses every review."""
    ca, names = getattr(args, "webhook_client_ca", None), list(getattr(args, "webhook_client_name", None) or [])
    if names and not ca:
        raise UserError("--webhook-client-name needs --webhook-client-ca (the CA that signs those names)")
    if ca:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=ca)
        except OSError as e:  # ssl.SSLError is one
            raise UserError(f"--webhook-client-ca {ca}: {e.strerror or e}") from None
    return {"client_ca": ca, "client_names": names}


def setup(settings: kopf.OperatorSettings, args: argparse.Namespace, store: Store | None = None, *,
          registry: kopf.OperatorRegistry | None = None, kube: certs.Api | None = None) -> None:
    """Register the handlers and configure settings.admission.server (nothing with --no-webhook).
    Certificates are prepared when Kopf starts the server, not here."""
    if getattr(args, "no_webhook", False):
        return
    auth = client_auth(args)
    register(registry, store, getattr(args, "default_image", None))

    def tls() -> Awaitable[tuple[Path | None, Path, Path]]:
        # the operator's own client configuration when it has one (tests point it at KMock)
        return prepare_tls(args, kube or certs.KubeApi(getattr(store or _default_store(), "kube_config", None)))

    settings.admission.server = Server(addr=args.webhook_host, port=args.webhook_port, tls=tls, **auth)
