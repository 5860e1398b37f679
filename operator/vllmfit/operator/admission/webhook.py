"""Admission webhooks for VLLMDeployment, served by the operator process (Kopf) over TLS.

- validate-vllmdeployment: reads the object with the one reader and validator (vllmfit.core.spec.read,
  as `vllmfit plan` and the operator do), resolves its model with the one resolver, and runs the same
  `placement.decide` as the operator and `vllmfit plan`, on the operator's committed snapshot of
  the ledger (frozen: no lock, never half-changed, never changed by the review). It never books:
  only the operator books, so dry runs change nothing. Denials carry the decision's reasons (per
  GPU) and its checked fixes. A review is bounded (defaults.REVIEW_BUDGET_S, inside the webhook's
  timeoutSeconds) and fair between namespaces (`Admission`); one that cannot be decided in time
  is refused, saying so, unless the operator runs with --webhook-fail-open.
- default-vllmdeployment: writes every pydantic default of api.VLLMDeploymentSpec that the object
  leaves out (image, dtype, replicas, placement.allowReschedule...), so what is stored is explicit.
  It never writes computed flags.

The webhook is advisory: two objects admitted in the same instant may not both fit; the operator's
serialized allocation is authoritative (docs/webhook.md). The pure part (defaults_patch,
is_shrink, check) has no Kopf in it; `register`/`setup` are the thin shell, and the HTTPS
server with its limits and client authentication is `vllmfit.operator.admission.webhookserver`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, Union, get_args, get_origin

import kopf
from pydantic import BaseModel

from vllmfit.core import defaults, placement
from vllmfit.core.errors import UserError
from vllmfit.core.spec import api, read, validate
from vllmfit.operator.admission import bounded, certs
from vllmfit.operator.admission.fairness import Admission
from vllmfit.operator.admission.webhookserver import MUTATE_ID, VALIDATE_ID, Server, clip
from vllmfit.operator.booking import models
from vllmfit.operator.booking.changes import memory_changes

logger = logging.getLogger(__name__)

OPERATIONS: list[Literal["CREATE", "UPDATE"]] = ["CREATE", "UPDATE"]
NOT_READY = "the operator has not rebuilt its ledger yet (it is starting); retry in a few seconds"
BUSY = "this namespace has {n} reviews deciding already"
LATE = ("vllmfit could not check it within {budget:g} s ({step}), so it refuses it; retry, "
        "or lower spec.replicas or the model's sizes")
FAIL_OPEN = "allowed unchecked (the operator runs with --webhook-fail-open); the operator will check"


class Store(Protocol):
    """What the webhook needs from vllmfit.operator.booking.state.Store."""

    ready: asyncio.Event

    def snapshot(self) -> placement.Ledger: ...

    async def request_for(self, obj: api.VLLMDeployment) -> placement.Request: ...


# --- The pure part ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    message: str = ""
    warnings: tuple[str, ...] = ()
    code: int = 200  # for denials: 403 does not fit, 422 invalid spec, 400 anything else


def late(adm: Admission, step: str, warnings: tuple[str, ...] = ()) -> Verdict:
    """A review that could not be decided in time: refused, or with --webhook-fail-open allowed
    with a warning that says it was not checked."""
    message = LATE.format(budget=adm.budget_s, step=step)
    if adm.fail_open:
        return Verdict(True, warnings=(*warnings, f"{message.split(', so')[0]}: {FAIL_OPEN}"))
    return Verdict(False, message, warnings, 429)


Invalid = read.SpecError
"""A spec the one reader or validator refuses (vllmfit.core.spec.read); one line naming the field."""


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


"""Spec fields that change neither the memory a deployment needs nor where it may run."""
SMALLER_NEEDS_LESS = frozenset(
    {"replicas", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"})


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
        keep = placement.held_replicas(ledger, req.key, min(old.replicas, req.spec.replicas), old_flags)
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
                 operation: str, dry_run: bool, admission: Admission | None = None) -> Verdict:
    """Validate one admission request against the committed snapshot of the ledger. Never books,
    takes no lock; bounded by `admission.budget_s` in all (see Admission)."""
    adm = admission or Admission()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + adm.budget_s
    unchanged = old_body is not None and body.get("spec") == old_body.get("spec")
    if operation == "UPDATE" and (unchanged or (body.get("metadata") or {}).get("deletionTimestamp")):
        return Verdict(True)  # metadata-only updates (finalizers, labels) are never re-checked
    # the one reader and validator, as the operator and `vllmfit plan` call them (generateName: the
    # API server makes a DNS label, so the name is not checked)
    policy = getattr(getattr(store, "options", None), "tenancy", validate.DEFAULT_POLICY)
    named = bool((body.get("metadata") or {}).get("name"))
    obj = await models.checked(getattr(store, "api", None), body, policy, named=named)
    old = None
    if operation == "UPDATE" and old_body is not None:
        try:
            old = read.deployment(old_body, status=True)
        except Invalid:
            old = None
        if old is not None and not memory_changes(old.spec, obj.spec):
            return Verdict(True)
    if not store.books.ready.is_set():
        return late(adm, "the operator is starting") if adm.fail_open else Verdict(False, NOT_READY, code=429)
    try:
        async with asyncio.timeout_at(deadline):
            req = await store.request_for(obj)
    except TimeoutError:
        return late(adm, f"resolving model {obj.spec.model!r}")
    except Exception as e:  # noqa: BLE001 - resolve.ModelResolutionError, or anything the resolver raises
        message = str(e) or f"cannot resolve model {obj.spec.model!r}"
        if getattr(e, "transient", False):  # Hub unreachable, ConfigMap not created yet: apply order
            return Verdict(True, warnings=(f"{message}; the operator will retry",))
        return Verdict(False, message, code=422)
    namespace = obj.metadata.namespace or "default"
    snapshot = store.books.snapshot()  # before the place is taken: nothing between them may raise
    if not await adm.slot(namespace, deadline):
        return late(adm, BUSY.format(n=adm.per_namespace))
    old_flags = old.status.flags if old is not None and old.status is not None else None
    # Off the event loop, on the committed snapshot (frozen: any number of reviews read it at once,
    # and no writer waits for them). The namespace's place is given back when the thread ends,
    # not when the review gives up on it: abandoned work counts against its own namespace.
    try:
        fut = loop.run_in_executor(store.workers.review(), functools.partial(
            check, snapshot, req, old=old.spec if old else None, dry_run=dry_run, old_flags=old_flags))
    except BaseException:
        adm.free(namespace)
        raise
    fut.add_done_callback(lambda f: (adm.free(namespace), f.cancelled() or f.exception()))
    limit = min(deadline - loop.time(), defaults.REVIEW_DECIDE_TIMEOUT_S)
    try:
        async with asyncio.timeout(limit):
            return await asyncio.shield(fut)
    except TimeoutError:
        store.workers.abandoned += 1
        if limit >= defaults.REVIEW_DECIDE_TIMEOUT_S:  # it had its own whole time: the spec is too costly
            return Verdict(False, bounded.too_costly_message(limit), code=422)
        return late(adm, "deciding where it fits")


def stored_object(store: Store, key: str) -> Mapping[str, Any] | None:
    """The VLLMDeployment `key` as the operator last saw it (its records), if it has one."""
    rec = store.cache.records.get(key)
    body = getattr(rec, "body", None)
    return body if isinstance(body, Mapping) else None


async def review_scale(store: Store, scale: Mapping[str, Any], dry_run: bool,
                       admission: Admission | None = None) -> Verdict:
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
    return await review(store, new, current, "UPDATE", dry_run, admission)


Observer = Callable[[str, str, float], None]
"""Told of every review answered: (webhook, outcome, seconds). The operator passes
vllmfit.operator.metrics.observe_review (the metrics module sits beside this one, not below)."""


def register(registry: kopf.OperatorRegistry | None, store: Store,
             default_image: str | None = None, admission: Admission | None = None,
             observer: Observer | None = None) -> None:
    """Register the two admission handlers (ids = URL paths) in `registry` (Kopf's default if None).
    `store`: the operator's state (booking.state.Store), whose committed ledger every review reads.
    `default_image`: the operator's --default-image, written by the mutating webhook instead of the
    pydantic default. `admission`: the bounds and fairness of reviews (one per webhook; default:
    fail closed). `observer`: told of every review answered (the operator's metrics)."""
    overrides = {"image": default_image} if default_image else {}
    adm = admission or Admission()

    def _observe(webhook: str, outcome: str, t0: float) -> None:
        if observer is not None:
            observer(webhook, outcome, time.monotonic() - t0)

    @kopf.on.validate(api.GROUP, api.VERSION, api.PLURAL, id=VALIDATE_ID, operations=OPERATIONS,
                      subresource="*", registry=registry)
    async def validate_vllmdeployment(body: kopf.Body, dryrun: bool, warnings: list[str], old: kopf.Body | None = None,
                                      operation: str = "CREATE", subresource: str | None = None, **_: Any) -> None:
        t0 = time.monotonic()
        try:
            if subresource == "scale":
                v = await review_scale(store, dict(body), dryrun, adm)
            elif subresource is not None:  # status is the operator's: never reviewed
                return
            else:
                v = await review(store, dict(body), dict(old) if old is not None else None,
                                 operation, dryrun, adm)
        except Invalid as e:
            _observe("validate", "invalid", t0)
            raise kopf.AdmissionError(clip(str(e)), code=422) from None
        except Exception as e:
            logger.exception("validating webhook failed")
            _observe("validate", "error", t0)
            raise kopf.AdmissionError(clip(f"vllmfit webhook error: {type(e).__name__}: {e}"), code=400) from None
        _observe("validate", "denied" if not v.allowed else "warned" if v.warnings else "allowed", t0)
        warnings.extend(clip(w) for w in v.warnings)
        if not v.allowed:
            raise kopf.AdmissionError(clip(v.message), code=v.code)

    @kopf.on.mutate(api.GROUP, api.VERSION, api.PLURAL, id=MUTATE_ID, operations=OPERATIONS, registry=registry)
    async def default_vllmdeployment(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        t0 = time.monotonic()
        spec = body.get("spec")
        if isinstance(spec, Mapping):  # anything else is for the validating webhook to deny
            for key, value in defaults_patch(spec, overrides=overrides).items():
                patch.spec[key] = value
        _observe("default", "allowed", t0)


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
    g.add_argument("--webhook-timeout-seconds", type=int, default=defaults.WEBHOOK_TIMEOUT_S, metavar="S",
                   help="the API server's timeoutSeconds for the validating webhook (chart value "
                        f"webhook.timeoutSeconds; default {defaults.WEBHOOK_TIMEOUT_S}): a review gets "
                        f"{defaults.REVIEW_BUDGET_FRACTION:g} of it in all")
    g.add_argument("--webhook-fail-open", action="store_true",
                   help="allow (with a warning) a spec the webhook cannot check in time, instead of "
                        "refusing it (default: refuse; chart value webhook.failOpen)")
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


def admission_of(args: argparse.Namespace) -> Admission:
    """The review bounds of --webhook-timeout-seconds and --webhook-fail-open."""
    timeout = getattr(args, "webhook_timeout_seconds", None) or defaults.WEBHOOK_TIMEOUT_S
    return Admission(fail_open=bool(getattr(args, "webhook_fail_open", False)),
                     budget_s=defaults.review_budget_s(timeout))


def setup(settings: kopf.OperatorSettings, args: argparse.Namespace, store: Store, *,
          registry: kopf.OperatorRegistry | None = None, kube: certs.Api | None = None,
          observer: Observer | None = None) -> None:
    """Register the handlers and configure settings.admission.server (nothing with --no-webhook).
    Certificates are prepared when Kopf starts the server, not here."""
    if getattr(args, "no_webhook", False):
        return
    auth = client_auth(args)
    register(registry, store, getattr(args, "default_image", None), admission_of(args), observer)

    def tls() -> Awaitable[tuple[Path | None, Path, Path]]:
        # the operator's own client configuration when it has one (tests point it at KMock)
        return prepare_tls(args, kube or certs.KubeApi(getattr(store, "kube_config", None)))

    settings.admission.server = Server(addr=args.webhook_host, port=args.webhook_port, tls=tls, **auth)
