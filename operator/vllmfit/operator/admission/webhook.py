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
import base64
import functools
import json
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Protocol

import kopf

from vllmfit.core import defaults, placement
from vllmfit.core.errors import UserError
from vllmfit.core.spec import api, read, validate
from vllmfit.operator.admission import bounded, certs
from vllmfit.operator.admission.fairness import Admission
from vllmfit.operator.admission.ownloop import at_home
from vllmfit.operator.admission.verdict import Verdict, check, defaults_patch, finalizer_ops, json_patch
from vllmfit.operator.admission.webhookserver import MUTATE_ID, VALIDATE_ID, Server, clip
from vllmfit.operator.booking import models
from vllmfit.operator.booking.changes import memory_changes
from vllmfit.sources import resolve

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


def late(adm: Admission, step: str, warnings: tuple[str, ...] = ()) -> Verdict:
    """A review that could not be decided in time: refused, or with --webhook-fail-open allowed
    with a warning that says it was not checked."""
    message = LATE.format(budget=adm.budget_s, step=step)
    if adm.fail_open:
        return Verdict(True, warnings=(*warnings, f"{message.split(', so')[0]}: {FAIL_OPEN}"))
    return Verdict(False, message, warnings, 429)


Invalid = read.SpecError
"""A spec the one reader or validator refuses (vllmfit.core.spec.read); one line naming the field."""


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
    try:  # the envFrom ConfigMaps are read on the operator's loop (at_home): within the budget too
        async with asyncio.timeout_at(deadline):
            obj = await models.checked(getattr(store, "api", None), body, policy, named=named, io=at_home)
    except TimeoutError:
        return late(adm, "reading the ConfigMaps its envFrom names")
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
            # a modelConfigRef is read through the operator's API client, on its loop
            req = await (at_home(lambda: store.request_for(obj)) if resolve.config_map_wanted(obj.spec) is not None
                         else store.request_for(obj))
    except TimeoutError:
        return late(adm, f"resolving model {obj.spec.model!r}")
    except Exception as e:  # noqa: BLE001 - resolve.ModelResolutionError, or anything the resolver raises
        message = str(e) or f"cannot resolve model {obj.spec.model!r}"
        if getattr(e, "transient", False):  # Hub unreachable, ConfigMap not created yet: apply order
            return Verdict(True, warnings=(f"{message}; the operator will retry",))
        return Verdict(False, message, code=422)
    namespace = obj.metadata.namespace or "default"
    snapshot = store.books.snapshot()
    old_flags = old.status.flags if old is not None and old.status is not None else None
    decision = functools.partial(check, snapshot, req, old=old.spec if old else None, dry_run=dry_run,
                                 old_flags=old_flags)
    # A decision that is a few bisections whatever the cluster's size (placement.quick: a few
    # replicas, no node selection) is made here, on the event loop, cheaper than the hop to a
    # thread (threads share the GIL anyway); if it fits, that is the verdict. Anything else - a
    # refusal and its checked fixes, many replicas, a node selection - is decided off the loop,
    # bounded in time and fair between namespaces.
    if placement.quick(snapshot, req, defaults.REVIEW_INLINE_REPLICAS) and (v := decision(quick=True)) is not None:
        return v
    if not await adm.slot(namespace, deadline):
        return late(adm, BUSY.format(n=adm.per_namespace))
    # Off the event loop, on the committed snapshot (frozen: any number of reviews read it at once,
    # and no writer waits for them). The namespace's place is given back when the thread ends,
    # not when the review gives up on it: abandoned work counts against its own namespace.
    try:
        fut = loop.run_in_executor(store.workers.review(), decision)
    except BaseException:
        adm.free(namespace)
        raise
    fut.add_done_callback(lambda f: (adm.free(namespace), f.cancelled() or f.exception()))
    limit = min(deadline - loop.time(), defaults.REVIEW_DECIDE_TIMEOUT_S)
    try:
        async with asyncio.timeout(limit):
            return await asyncio.shield(fut)
    except TimeoutError:
        store.workers.give_up()
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


class Reviewer:
    """Both webhooks' answers. The server calls `answer` with each AdmissionReview it has read and
    checked (webhookserver.Server); the Kopf handlers `register` adds call the same two methods, so
    Kopf's own dispatch (and the webhook configurations Kopf derives from its handlers) give the
    same verdicts. The server does not go through Kopf's dispatch because it costs more than the
    review itself: per request it builds a cause, deep-copies the body and diffs it (docs/webhook.md,
    "Cost of a review")."""

    def __init__(self, store: Store, default_image: str | None = None, admission: Admission | None = None,
                 observer: Observer | None = None):
        self.store, self.admission, self.observer = store, admission or Admission(), observer
        self.overrides = {"image": default_image} if default_image else {}

    def _observe(self, webhook: str, outcome: str, t0: float) -> None:
        if self.observer is not None:
            self.observer(webhook, outcome, time.monotonic() - t0)

    async def validate(self, body: Mapping[str, Any], old: Mapping[str, Any] | None, operation: str,
                       subresource: str | None, dry_run: bool) -> Verdict:
        """The validating webhook's verdict; never raises (an invalid spec is a 422 denial, any
        other failure a 400 denial that names it)."""
        if subresource is not None and subresource != "scale":  # status is the operator's: never reviewed
            return Verdict(True)
        t0 = time.monotonic()
        try:
            if subresource == "scale":
                v = await review_scale(self.store, body, dry_run, self.admission)
            else:
                v = await review(self.store, body, old, operation, dry_run, self.admission)
        except Invalid as e:
            self._observe("validate", "invalid", t0)
            return Verdict(False, clip(str(e)), code=422)
        except Exception as e:
            logger.exception("validating webhook failed")
            self._observe("validate", "error", t0)
            return Verdict(False, clip(f"vllmfit webhook error: {type(e).__name__}: {e}"), code=400)
        self._observe("validate", "denied" if not v.allowed else "warned" if v.warnings else "allowed", t0)
        return replace(v, message=clip(v.message), warnings=tuple(clip(w) for w in v.warnings))

    def default(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The mutating webhook's merge patch of spec (empty when spec is not an object: the
        validating webhook denies that)."""
        t0 = time.monotonic()
        spec = body.get("spec")
        patch = defaults_patch(spec, overrides=self.overrides) if isinstance(spec, Mapping) else {}
        self._observe("default", "allowed", t0)
        return patch

    async def answer(self, hook: str, data: dict[str, Any]) -> dict[str, Any]:
        """The AdmissionReview response to `data` (checked by webhookserver.review_problem) for
        the webhook at path `hook`, as Kopf's dispatch would build it."""
        req = data["request"]
        response: dict[str, Any] = {"uid": req["uid"], "allowed": True}
        out = {"apiVersion": data.get("apiVersion", "admission.k8s.io/v1"),
               "kind": data.get("kind", "AdmissionReview"), "response": response}
        resource = req["resource"]
        if (resource["group"], resource["version"], resource["resource"]) != (api.GROUP, api.VERSION, api.PLURAL):
            response.update(allowed=False, status={"code": 400, "message": f"The specified resource has no "
                                                   f"handlers: {resource}"})
            return out
        operation, subresource = req["operation"], req.get("subResource")
        if operation not in OPERATIONS:  # the configurations never send others
            return out
        body = req.get("object") if isinstance(req.get("object"), dict) else req.get("oldObject")
        old = req.get("oldObject") if isinstance(req.get("oldObject"), dict) else None
        if hook == VALIDATE_ID:
            v = await self.validate(body, old, operation, subresource, bool(req.get("dryRun")))
            if v.warnings:
                response["warnings"] = list(v.warnings)
            if not v.allowed:
                response.update(allowed=False, status={"code": v.code, "message": v.message})
        elif subresource is None and (ops := json_patch(body.get("spec") or {}, self.default(body), "/spec") + (
                finalizer_ops(body.get("metadata")) if operation == "CREATE" else [])):
            response.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(ops).encode()).decode())
        return out


def register(registry: kopf.OperatorRegistry | None, store: Store,
             default_image: str | None = None, admission: Admission | None = None,
             observer: Observer | None = None) -> Reviewer:
    """Register the two admission handlers (ids = URL paths) in `registry` (Kopf's default if None)
    and return the Reviewer they call. `store`: the operator's state (booking.state.Store), whose
    committed ledger every review reads. `default_image`: the operator's --default-image, written
    by the mutating webhook instead of the pydantic default. `admission`: the bounds and fairness
    of reviews (default: fail closed). `observer`: told of every review answered (the metrics)."""
    reviewer = Reviewer(store, default_image, admission, observer)

    @kopf.on.validate(api.GROUP, api.VERSION, api.PLURAL, id=VALIDATE_ID, operations=OPERATIONS,
                      subresource="*", registry=registry)
    async def validate_vllmdeployment(body: kopf.Body, dryrun: bool, warnings: list[str], old: kopf.Body | None = None,
                                      operation: str = "CREATE", subresource: str | None = None, **_: Any) -> None:
        v = await reviewer.validate(dict(body), dict(old) if old is not None else None, operation, subresource, dryrun)
        warnings.extend(v.warnings)
        if not v.allowed:
            raise kopf.AdmissionError(v.message, code=v.code)

    @kopf.on.mutate(api.GROUP, api.VERSION, api.PLURAL, id=MUTATE_ID, operations=OPERATIONS, registry=registry)
    async def default_vllmdeployment(body: kopf.Body, patch: kopf.Patch, operation: str = "CREATE", **_: Any) -> None:
        for key, value in reviewer.default(body).items():
            patch.spec[key] = value
        if operation == "CREATE" and finalizer_ops(body.get("metadata")):
            patch.meta["finalizers"] = [*((body.get("metadata") or {}).get("finalizers") or []), api.FINALIZER]

    return reviewer


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
    reviewer = register(registry, store, getattr(args, "default_image", None), admission_of(args), observer)

    def tls() -> Awaitable[tuple[Path | None, Path, Path]]:
        # the operator's own client configuration when it has one (tests point it at KMock)
        return prepare_tls(args, kube or certs.KubeApi(getattr(store, "kube_config", None)))

    server = settings.admission.server = Server(addr=args.webhook_host, port=args.webhook_port, tls=tls,
                                                answer=reviewer.answer, **auth)

    @kopf.on.probe(id="webhook", registry=registry)
    async def webhook_loop(**_: Any) -> str:
        return await server.own.answering()  # the reviews' loop is not Kopf's: liveness asks it too
