"""A running webhook for the tests and the benchmark: KMock as the API server and a Kopf operator
with only the webhook registered (vllmfit.operator.admission.webhook.setup), in a background thread with its
own event loop, serving HTTPS on 127.0.0.1 with certificates made by certs.py and kept in a KMock
Secret. Tests talk to it with plain (sync or async) HTTP clients from the main thread.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import functools
import json
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Self

import kmock
import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes_asyncio import client as kclient

from vllmfit.core import placement
from vllmfit.core.spec import api
from vllmfit.operator.admission import certs, webhook
from vllmfit.operator.booking.state import Workers
from vllmfit.sources import catalog, resolve

RESOURCE = f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"
VWC = "admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
MWC = "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
NAMESPACE = "vllmfit-system"
SERVICE = "vllmfit-webhook"
SECRET = "vllmfit-webhook-cert"
NAMES = {"validating": "vllmfit-validate", "mutating": "vllmfit-default"}  # as the chart names them
H100 = "NVIDIA-H100-80GB-HBM3"


def gfd_node(name: str, count: int = 8, product: str = H100) -> dict[str, Any]:
    """A v1/Node labelled by GPU Feature Discovery."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(count)}}}


@functools.cache
def _model(name: str) -> Any:
    return catalog.model(name)  # catalog.model rebuilds its alias table on every call (~0.3 ms)


class FakeBooks:
    """The books as the webhook reads them (ready, snapshot); `ledger` is what the tests book
    into (the operator's writer ledger), `snapshot()` freezes it as it is."""

    def __init__(self, ledger: placement.Ledger, ready: bool) -> None:
        self.ledger = ledger
        self.lock = asyncio.Lock()
        self.ready = asyncio.Event()
        if ready:
            self.ready.set()

    def snapshot(self) -> placement.Ledger:
        return self.ledger.snapshot()


class FakeStore:
    """The Store interface the webhook uses (books, cache.records, request_for) over the catalog."""

    def __init__(self, nodes: Iterable[Mapping[str, Any]] = (), *, ready: bool = True):
        self.books = FakeBooks(placement.Ledger(placement.node_from_object(n, catalog.gpu_for_label) for n in nodes),
                               ready)
        self.cache = SimpleNamespace(records={})  # key -> an object with .body, as the operator's Cache has
        self.workers = Workers()  # the threads reviews run in

    async def request_for(self, obj: api.VLLMDeployment) -> placement.Request:
        """The one resolver without the Hub (no network in tests: a name the catalog does not know is
        refused with the catalog's line) and without ConfigMaps (a modelConfigRef is not found)."""
        spec = obj.spec
        if spec.model_config_inline is not None or spec.model_config_ref is not None:
            return placement.request_from_object(obj, resolve.resolve(spec, obj.metadata.namespace))
        try:
            return placement.request_from_object(obj, _model(spec.model))
        except catalog.CatalogError as e:
            raise resolve.ModelResolutionError(str(e)) from None


def webhook_configuration(kind: str, paths: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """A service-based webhook configuration as the Helm chart renders it (caBundle empty)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": f"{kind}WebhookConfiguration",
        "metadata": {"name": NAMES[kind.lower()]},
        "webhooks": [{
            "name": name,
            "clientConfig": {"service": {"name": SERVICE, "namespace": NAMESPACE, "path": f"/{path}", "port": 443}},
            "rules": [{"apiGroups": [api.GROUP], "apiVersions": [api.VERSION], "resources": [api.PLURAL],
                       "operations": ["CREATE", "UPDATE"]}],
            "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 5, "failurePolicy": "Fail",
        } for name, path in paths],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--namespace")  # the operator's flags
    p.add_argument("--default-image")
    webhook.add_arguments(p)
    return p


class Harness:
    def __init__(self, store: Any, extra_args: Iterable[str] = (), *, configs: bool = True,
                 file_check_interval: float | None = None, observer: webhook.Observer | None = None):
        self.store = store
        self.observer = observer  # told of every review (the operator passes its metrics)
        self.file_check_interval = file_check_interval
        self.port = free_port()
        self.args = parser().parse_args(["--namespace", NAMESPACE, "--webhook-host", "127.0.0.1",
                                         "--webhook-port", str(self.port), "--webhook-service", SERVICE,
                                         "--cert-secret", SECRET, "--validating-webhook", NAMES["validating"],
                                         "--mutating-webhook", NAMES["mutating"], *extra_args])
        self.configs = configs
        self.url = f"https://127.0.0.1:{self.port}"
        self.liveness_endpoint: str | None = None  # Kopf's /healthz, when a test sets it before starting
        self.loop: asyncio.AbstractEventLoop | None = None
        self.kmock: Any = None
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="webhook-harness")

    # lifecycle
    def __enter__(self) -> Self:
        self._thread.start()
        if not self._started.wait(30) or self.error:
            raise RuntimeError(f"webhook harness did not start: {self.error!r}")
        return self

    def __exit__(self, *_: object) -> None:
        if self.loop and self._stop:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self.error = e
            self._started.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if isinstance(self.store.books, FakeBooks):  # its asyncio primitives must live in this loop
            self.store.books.lock, ready = asyncio.Lock(), self.store.books.ready.is_set()
            self.store.books.ready = asyncio.Event()
            if ready:
                self.store.books.ready.set()
        async with kmock.KubernetesEmulator() as k, kmock.Server(k):
            self.kmock = k
            k.resources.load_bundled()
            k.resources[RESOURCE] = kmock.ResourceInfo(
                kind=api.KIND, namespaced=True, subresources={"status"},
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
            if self.configs:
                k.objects[k.resource(VWC), None, NAMES["validating"]] = webhook_configuration(
                    "Validating", [("validate.vllmfit.dev", webhook.VALIDATE_ID)])
                k.objects[k.resource(MWC), None, NAMES["mutating"]] = webhook_configuration(
                    "Mutating", [("default.vllmfit.dev", webhook.MUTATE_ID)])
            registry = kopf.OperatorRegistry()

            @kopf.on.login(registry=registry)
            def login(**_: Any) -> kopf.ConnectionInfo:
                return kopf.ConnectionInfo(server=str(k.url), insecure=True)

            settings = kopf.OperatorSettings()
            settings.posting.enabled = False
            self.kube = certs.KubeApi(kclient.Configuration(host=str(k.url).rstrip("/")))
            webhook.setup(settings, self.args, self.store, registry=registry, kube=self.kube,
                          observer=self.observer)
            self.server = settings.admission.server
            if self.file_check_interval is not None:
                settings.admission.server.file_check_interval = self.file_check_interval
            try:
                await self._operate(registry, settings)
            finally:
                await self.kube.close()

    async def _operate(self, registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings) -> None:
        """Run the Kopf operator until the harness stops; it has started once it serves."""
        assert self._stop is not None  # made in this loop by _main
        task = asyncio.create_task(kopf.operator(registry=registry, settings=settings, clusterwide=True,
                                                 standalone=True, liveness_endpoint=self.liveness_endpoint))
        try:
            await self._wait_serving()
            self._started.set()
            await self._stop.wait()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _wait_serving(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.02)
        raise TimeoutError("webhook server did not listen")

    # helpers for the tests
    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine in the server's loop (e.g. to change the ledger under the lock)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def secret(self) -> dict[str, Any] | None:
        key = (self.kmock.resource("v1/secrets"), NAMESPACE, SECRET)
        return self.kmock.objects[key].raw if key in self.kmock.objects else None

    def config(self, which: str) -> dict[str, Any]:
        return self.kmock.objects[self.kmock.resource(VWC if which == "validating" else MWC), None, NAMES[which]].raw

    def ca_pem(self) -> bytes:
        """The CA as the apiserver would read it: from the injected caBundle."""
        return base64.b64decode(self.config("validating")["webhooks"][0]["clientConfig"]["caBundle"])

    def ssl_context(self, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
        """A client context trusting the injected CA (and presenting `cert`: (certfile, keyfile))."""
        ctx = ssl.create_default_context(cadata=self.ca_pem().decode())
        if cert is not None:
            ctx.load_cert_chain(*cert)
        return ctx


def client_ca(name: str = "test API server client CA") -> tuple[bytes, Any]:
    """A CA for API server client certificates: (PEM, signer) for client_cert()."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), (cert, key)


def client_cert(signer: Any, directory: Path, cn: str, dns: Iterable[str] = ()) -> tuple[Path, Path]:
    """A client certificate (extendedKeyUsage clientAuth, as kube-apiserver's would be) signed by
    `signer` (client_ca()[1]); written as PEM files, returns (certfile, keyfile)."""
    ca, ca_key = signer
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
               .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"{cn}-{uuid.uuid4().hex[:8]}"
    certfile, keyfile = stem.with_suffix(".crt"), stem.with_suffix(".key")
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


def admission_review(obj: Any, *, operation: str = "CREATE", old: Any = None, dry_run: bool = False,
                     uid: str | None = None, namespace: str = "default") -> dict[str, Any]:
    """An AdmissionReview v1 request as kube-apiserver sends it."""
    name = obj.get("metadata", {}).get("name", "") if isinstance(obj, dict) else ""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid or str(uuid.uuid4()),
        "kind": {"group": api.GROUP, "version": api.VERSION, "kind": api.KIND},
        "resource": {"group": api.GROUP, "version": api.VERSION, "resource": api.PLURAL},
        "requestKind": {"group": api.GROUP, "version": api.VERSION, "kind": api.KIND},
        "requestResource": {"group": api.GROUP, "version": api.VERSION, "resource": api.PLURAL},
        "name": name, "namespace": namespace, "operation": operation,
        "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]},
        "object": obj, "oldObject": old, "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions"},
    }}


def vllmd(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())}, "spec": spec}


def response_of(http_response: Any) -> dict[str, Any]:
    body = http_response.json() if hasattr(http_response, "json") else json.loads(http_response)
    return body["response"]


FUZZ_COUNTS: dict[str, Any] = {"specs": 0, "bodies": 0, "requests": 0, "outcomes": {}}
"""Inputs the fuzz tests posted (printed by conftest.py at the end of the run)."""
