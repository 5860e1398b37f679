"""TLS for the admission webhook: a CA and a serving certificate, kept in a Secret.

Kopf's built-in self-signed certificates need oscrypto, which fails with OpenSSL >= 3.0.10
(docs/webhook.md), so the certificates are made here with `cryptography`:

- `generate(service, namespace)` makes a CA and a serving certificate for the Service's DNS names
  (plus localhost and 127.0.0.1, for tests and port-forwards);
- `ensure(api, namespace, secret, service)` reads the bundle from the Secret, or creates the Secret;
  when another replica wins the create (409), its bundle is read back, so every replica and every
  restart serves the same CA;
- `inject_ca(api, ...)` writes the CA into webhooks[*].clientConfig.caBundle of the
  Validating/MutatingWebhookConfigurations (a JSON patch);
- with cert-manager (`--cert-dir`), none of this runs: its files are served as they are and its
  cainjector fills the caBundle.

The Kubernetes access is the small `KubeApi` class (kubernetes_asyncio); tests pass one pointed
at KMock, or any object with the same five methods (`Api`).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

logger = logging.getLogger(__name__)

CA_KEY, CERT_KEY, PKEY_KEY = "ca.crt", "tls.crt", "tls.key"
VALID_DAYS = 3650
RENEW_BEFORE_DAYS = 30
LOCAL_SANS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Bundle:
    """PEM bytes of the CA certificate, the serving certificate and its private key."""

    ca_crt: bytes
    tls_crt: bytes
    tls_key: bytes

    def as_secret_data(self) -> dict[str, str]:
        return {k: base64.b64encode(v).decode() for k, v in
                ((CA_KEY, self.ca_crt), (CERT_KEY, self.tls_crt), (PKEY_KEY, self.tls_key))}

    @classmethod
    def from_secret_data(cls, data: dict[str, str] | None) -> Bundle | None:
        data = data or {}
        if not all(data.get(k) for k in (CA_KEY, CERT_KEY, PKEY_KEY)):
            return None
        return cls(*(base64.b64decode(data[k]) for k in (CA_KEY, CERT_KEY, PKEY_KEY)))


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names the apiserver may use for a Service."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def generate(service: str, namespace: str, *, extra_sans: tuple[str, ...] = LOCAL_SANS,
             days: int = VALID_DAYS) -> Bundle:
    """A new CA and a serving certificate (ECDSA P-256) for the Service's names plus `extra_sans`."""
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"vllmfit webhook CA ({namespace}/{service})")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = service_names(service, namespace) + [n for n in extra_sans if n]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[2])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in dict.fromkeys(names)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return Bundle(
        ca.public_bytes(pem),
        cert.public_bytes(pem),
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def problem(bundle: Bundle, service: str, namespace: str, *, now: datetime.datetime | None = None) -> str | None:
    """Why a stored bundle cannot be served (unparsable, not covering the Service's names, expiring
    within RENEW_BEFORE_DAYS), or None when it can."""
    try:
        cert = x509.load_pem_x509_certificate(bundle.tls_crt)
        x509.load_pem_x509_certificate(bundle.ca_crt)
        serialization.load_pem_private_key(bundle.tls_key, password=None)
        sans = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName))
    except (ValueError, TypeError, x509.ExtensionNotFound) as e:
        return f"unreadable certificate: {e}"
    missing = [n for n in service_names(service, namespace) if n not in sans]
    if missing:
        return f"certificate does not cover {', '.join(missing)}"
    now = now or datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc - now < datetime.timedelta(days=RENEW_BEFORE_DAYS):
        return f"certificate expires {cert.not_valid_after_utc:%Y-%m-%d}"
    return None


def write(bundle: Bundle, directory: str | os.PathLike[str] | None = None) -> tuple[Path, Path, Path]:
    """Write the bundle as ca.crt, tls.crt, tls.key (the key 0600) into `directory` (a new temp dir
    by default). Returns the three paths."""
    d = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="vllmfit-webhook-"))
    d.mkdir(parents=True, exist_ok=True)
    paths = d / CA_KEY, d / CERT_KEY, d / PKEY_KEY
    for path, data in zip(paths, (bundle.ca_crt, bundle.tls_crt, bundle.tls_key)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return paths


# --- Kubernetes access ---------------------------------------------------------------------------


class Api(Protocol):
    async def read_secret(self, namespace: str, name: str) -> tuple[dict[str, str], str | None] | None:
        """(data, resourceVersion) of the Secret, or None when it does not exist."""

    async def create_secret(self, namespace: str, name: str, data: dict[str, str]) -> bool:
        """Create it; False when it already exists (409)."""

    async def update_secret(self, namespace: str, name: str, data: dict[str, str], version: str | None) -> bool:
        """Replace its data if it is still at `version`; False when another writer got there first (409)."""

    async def webhook_configuration(self, kind: str, name: str) -> dict[str, Any] | None:
        """The Validating/MutatingWebhookConfiguration (kind 'validating' or 'mutating'), or None."""

    async def patch_webhook_configuration(self, kind: str, name: str, patch: list[dict[str, Any]]) -> None:
        """Apply a JSON patch to it."""


class KubeApi:
    """`Api` over kubernetes_asyncio. `configuration=None`: in-cluster, else the kubeconfig."""

    def __init__(self, configuration: Any = None):
        self._configuration = configuration
        self._client: Any = None

    async def _api(self) -> Any:
        from kubernetes_asyncio import client, config

        if self._client is None:
            if self._configuration is None:
                self._configuration = client.Configuration()
                try:
                    config.load_incluster_config(client_configuration=self._configuration)
                except config.ConfigException:
                    await config.load_kube_config(client_configuration=self._configuration)
            self._client = client.ApiClient(self._configuration)
        return client, self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def read_secret(self, namespace: str, name: str) -> tuple[dict[str, str], str | None] | None:
        client, api = await self._api()
        try:
            s = await client.CoreV1Api(api).read_namespaced_secret(name, namespace)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return s.data or {}, s.metadata.resource_version if s.metadata else None

    async def create_secret(self, namespace: str, name: str, data: dict[str, str]) -> bool:
        client, api = await self._api()
        body = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "data": data,
                "metadata": {"name": name, "namespace": namespace,
                             "labels": {"app.kubernetes.io/managed-by": "vllmfit"}}}
        try:
            await client.CoreV1Api(api).create_namespaced_secret(namespace, body)
        except client.ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    async def update_secret(self, namespace: str, name: str, data: dict[str, str], version: str | None) -> bool:
        client, api = await self._api()
        body = {"metadata": {"resourceVersion": version} if version else {}, "data": data}
        try:
            await client.CoreV1Api(api).patch_namespaced_secret(name, namespace, body)
        except client.ApiException as e:
            if e.status in (404, 409):
                return False
            raise
        return True

    async def webhook_configuration(self, kind: str, name: str) -> dict[str, Any] | None:
        client, api = await self._api()
        reg = client.AdmissionregistrationV1Api(api)
        read = (reg.read_validating_webhook_configuration if kind == "validating"
                else reg.read_mutating_webhook_configuration)
        try:
            obj = await read(name)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return api.sanitize_for_serialization(obj)

    async def patch_webhook_configuration(self, kind: str, name: str, patch: list[dict[str, Any]]) -> None:
        client, api = await self._api()
        reg = client.AdmissionregistrationV1Api(api)
        fn = (reg.patch_validating_webhook_configuration if kind == "validating"
              else reg.patch_mutating_webhook_configuration)
        await fn(name, patch, _content_type="application/json-patch+json")


async def ensure(api: Api, namespace: str, secret: str, service: str) -> Bundle:
    """The bundle stored in the Secret; created when absent, replaced when unusable (`problem`).
    Safe with several replicas starting at once: a create that gets 409, or an update whose
    resourceVersion is stale, reads the winner's bundle instead."""
    for _ in range(5):
        found = await api.read_secret(namespace, secret)
        if found is None:
            bundle = generate(service, namespace)
            if await api.create_secret(namespace, secret, bundle.as_secret_data()):
                logger.info("Created the webhook certificate Secret %s/%s", namespace, secret)
                return bundle
            continue
        data, version = found
        stored = Bundle.from_secret_data(data)
        why = "missing keys" if stored is None else problem(stored, service, namespace)
        if stored is not None and why is None:
            return stored
        logger.warning("Secret %s/%s is unusable (%s); replacing its certificate", namespace, secret, why)
        bundle = generate(service, namespace)
        if await api.update_secret(namespace, secret, bundle.as_secret_data(), version):
            return bundle
    raise RuntimeError(f"could not create or read a usable Secret {namespace}/{secret}")


def ca_patch(configuration: dict[str, Any], ca_pem: bytes,
             failure_policy: str | None = None) -> list[dict[str, Any]]:
    """JSON patch ops that set every webhook's clientConfig.caBundle (and failurePolicy, if given)
    where it differs. Pure."""
    b64 = base64.b64encode(ca_pem).decode()
    ops: list[dict[str, Any]] = []
    for i, hook in enumerate(configuration.get("webhooks") or []):
        if (hook.get("clientConfig") or {}).get("caBundle") != b64:
            if "clientConfig" not in hook:
                ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig", "value": {}})
            ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": b64})
        if failure_policy and hook.get("failurePolicy") != failure_policy:
            ops.append({"op": "add", "path": f"/webhooks/{i}/failurePolicy", "value": failure_policy})
    return ops


async def inject_ca(api: Api, kind: str, name: str, ca_pem: bytes, failure_policy: str | None = None) -> bool:
    """Put the CA into the named webhook configuration. False (logged) when it does not exist."""
    configuration = await api.webhook_configuration(kind, name)
    if configuration is None:
        logger.warning("%sWebhookConfiguration %s not found; its caBundle was not set", kind.capitalize(), name)
        return False
    ops = ca_patch(configuration, ca_pem, failure_policy)
    if ops:
        await api.patch_webhook_configuration(kind, name, ops)
        logger.info("Set the caBundle of %sWebhookConfiguration %s", kind.capitalize(), name)
    return True
