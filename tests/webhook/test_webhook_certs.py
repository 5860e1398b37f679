"""certs.py: the CA and serving certificate, the Secret that keeps them, the caBundle injection.

TLS is checked with real handshakes (Python's ssl module), the Secret and the webhook
configurations through kubernetes_asyncio against KMock, and the multi-replica race with a fake
API whose create yields to the other replica before storing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import ssl
import stat

import kmock
import pytest
from cryptography import x509
from kubernetes_asyncio import client as kclient
from webhook_harness import MWC, NAMES, VWC, parser, webhook_configuration

from vllmfit.operator.admission import certs, webhook

SVC, NS = "vllmfit-webhook", "vllmfit-system"
DNS = ["vllmfit-webhook", "vllmfit-webhook.vllmfit-system", "vllmfit-webhook.vllmfit-system.svc",
       "vllmfit-webhook.vllmfit-system.svc.cluster.local"]


@pytest.fixture(scope="module")
def bundle() -> certs.Bundle:
    return certs.generate(SVC, NS)


def test_the_certificate_names_the_service_and_localhost(bundle):
    cert = x509.load_pem_x509_certificate(bundle.tls_crt)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [*DNS, "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(bundle.ca_crt))
    assert cert.not_valid_after_utc - cert.not_valid_before_utc > datetime.timedelta(days=3000)


async def handshake(bundle: certs.Bundle, server_hostname: str, tmp_path) -> None:
    """A TLS handshake with a server presenting the bundle, the client trusting only its CA."""
    _, crt, key = certs.write(bundle, tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(crt, key)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        client_ctx = ssl.create_default_context(cadata=bundle.ca_crt.decode())
        _, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx, server_hostname=server_hostname)
        w.close()
    finally:
        server.close()


@pytest.mark.parametrize("name", [*DNS, "localhost", "127.0.0.1"])
async def test_a_client_trusting_the_ca_accepts_every_service_name(bundle, name, tmp_path):
    await handshake(bundle, name, tmp_path)


async def test_a_client_refuses_other_names_and_other_cas(bundle, tmp_path):
    with pytest.raises(ssl.SSLCertVerificationError):
        await handshake(bundle, "other.vllmfit-system.svc", tmp_path)
    other = certs.generate(SVC, NS)
    mixed = certs.Bundle(other.ca_crt, bundle.tls_crt, bundle.tls_key)
    with pytest.raises(ssl.SSLCertVerificationError):
        await handshake(mixed, DNS[2], tmp_path)


def test_files_are_written_with_a_private_key(bundle, tmp_path):
    ca, crt, key = certs.write(bundle, tmp_path / "d")
    assert (ca.read_bytes(), crt.read_bytes(), key.read_bytes()) == (bundle.ca_crt, bundle.tls_crt, bundle.tls_key)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_problem_finds_unusable_bundles(bundle):
    assert certs.problem(bundle, SVC, NS) is None
    assert "does not cover" in certs.problem(bundle, "renamed", NS)
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3640)
    assert "expires" in certs.problem(bundle, SVC, NS, now=later)
    assert "unreadable" in certs.problem(certs.Bundle(b"x", b"y", b"z"), SVC, NS)


# --- ensure: create, reuse, race, replace --------------------------------------------------------


class FakeApi:
    """Secrets in a dict. create/update yield first, like a network call, so replicas interleave."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], tuple[dict[str, str], str]] = {}
        self.creates = 0

    async def read_secret(self, namespace, name):
        await asyncio.sleep(0)
        return self.secrets.get((namespace, name))

    async def create_secret(self, namespace, name, data):
        self.creates += 1
        await asyncio.sleep(0)
        if (namespace, name) in self.secrets:
            return False
        self.secrets[namespace, name] = (data, "1")
        return True

    async def update_secret(self, namespace, name, data, version):
        await asyncio.sleep(0)
        if self.secrets.get((namespace, name), ({}, None))[1] != version:
            return False
        self.secrets[namespace, name] = (data, str(int(version) + 1))
        return True


async def test_the_secret_is_created_once_and_reused_on_restart():
    api = FakeApi()
    first = await certs.ensure(api, NS, "tls", SVC)
    again = await certs.ensure(api, NS, "tls", SVC)
    assert first == again and api.creates == 1
    assert certs.Bundle.from_secret_data(api.secrets[NS, "tls"][0]) == first


async def test_replicas_starting_together_serve_the_winners_bundle():
    api = FakeApi()
    bundles = await asyncio.gather(*(certs.ensure(api, NS, "tls", SVC) for _ in range(4)))
    assert api.creates == 4  # every replica tried; one won
    assert len(set(bundles)) == 1 and bundles[0] == certs.Bundle.from_secret_data(api.secrets[NS, "tls"][0])


async def test_an_unusable_secret_is_replaced_and_racing_replacers_agree():
    api = FakeApi()
    api.secrets[NS, "tls"] = ({"ca.crt": "", "tls.crt": "eA==", "tls.key": "eA=="}, "7")
    bundles = await asyncio.gather(*(certs.ensure(api, NS, "tls", SVC) for _ in range(3)))
    assert len(set(bundles)) == 1 and certs.problem(bundles[0], SVC, NS) is None
    assert api.secrets[NS, "tls"][1] == "8"  # one replacement won; the others read it


def test_ca_patch_sets_every_webhook_and_only_what_differs():
    conf = webhook_configuration("Validating", [("a.vllmfit.dev", "x"), ("b.vllmfit.dev", "y")])
    b64 = base64.b64encode(b"CA").decode()
    ops = certs.ca_patch(conf, b"CA", "Ignore")
    assert ops == [
        {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": b64},
        {"op": "add", "path": "/webhooks/0/failurePolicy", "value": "Ignore"},
        {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": b64},
        {"op": "add", "path": "/webhooks/1/failurePolicy", "value": "Ignore"},
    ]
    for hook in conf["webhooks"]:
        hook["clientConfig"]["caBundle"], hook["failurePolicy"] = b64, "Ignore"
    assert certs.ca_patch(conf, b"CA", "Ignore") == []


# --- against KMock, through kubernetes_asyncio --------------------------------------------------


@pytest.fixture
def cluster(kmock):
    kmock.resources.load_bundled()
    kmock.objects[kmock.resource(VWC), None, NAMES["validating"]] = webhook_configuration(
        "Validating", [("validate.vllmfit.dev", webhook.VALIDATE_ID), ("other.vllmfit.dev", "other")])
    kmock.objects[kmock.resource(MWC), None, NAMES["mutating"]] = webhook_configuration(
        "Mutating", [("default.vllmfit.dev", webhook.MUTATE_ID)])
    return kmock


@pytest.fixture
async def kube(cluster):
    api = certs.KubeApi(kclient.Configuration(host=str(cluster.url).rstrip("/")))
    yield api
    await api.close()


def args(*extra: str) -> argparse.Namespace:
    return parser().parse_args(["--namespace", NS, "--webhook-service", SVC, *extra])


async def test_kube_api_secret_round_trip(kube):
    assert await kube.read_secret(NS, "s") is None
    assert await kube.create_secret(NS, "s", {"a": "Yg=="}) is True
    assert await kube.create_secret(NS, "s", {"a": "Yw=="}) is False  # 409
    data, _ = await kube.read_secret(NS, "s")
    assert data == {"a": "Yg=="}
    assert await kube.update_secret(NS, "s", {"a": "ZA=="}, None) is True
    assert (await kube.read_secret(NS, "s"))[0] == {"a": "ZA=="}


async def test_prepare_tls_keeps_the_bundle_in_a_secret_and_injects_the_ca(cluster, kube, tmp_path):
    ca, crt, _ = await webhook.prepare_tls(args("--webhook-failure-policy", "Ignore"), kube)
    secret = cluster.objects[cluster.resource("v1/secrets"), NS, "vllmfit-webhook-cert"]
    assert base64.b64decode(secret["data"]["ca.crt"]) == ca.read_bytes()
    assert base64.b64decode(secret["data"]["tls.crt"]) == crt.read_bytes()
    b64 = base64.b64encode(ca.read_bytes()).decode()
    vwc = cluster.objects[cluster.resource(VWC), None, NAMES["validating"]]
    mwc = cluster.objects[cluster.resource(MWC), None, NAMES["mutating"]]
    assert [h["clientConfig"]["caBundle"] for h in vwc["webhooks"]] == [b64, b64]
    assert [h["failurePolicy"] for h in vwc["webhooks"]] == ["Ignore", "Ignore"]
    assert [h["clientConfig"]["caBundle"] for h in mwc["webhooks"]] == [b64]
    assert [h["failurePolicy"] for h in mwc["webhooks"]] == ["Fail"]  # the flag is for validation
    assert [h["clientConfig"]["service"]["path"] for h in mwc["webhooks"]] == ["/default-vllmdeployment"]
    # a restart (new process, new temp dir) serves the same CA
    ca2, _, _ = await webhook.prepare_tls(args(), kube)
    assert ca2 != ca and ca2.read_bytes() == ca.read_bytes()
    assert len(cluster.objects[cluster.resource("v1/secrets"), NS, "vllmfit-webhook-cert"].history) == 1


async def test_missing_webhook_configurations_are_logged_not_fatal(kube, caplog):
    paths = await webhook.prepare_tls(args("--validating-webhook", "absent", "--mutating-webhook", ""), kube)
    assert all(p.exists() for p in paths)
    assert "ValidatingWebhookConfiguration absent not found" in caplog.text


async def test_cert_manager_files_are_served_as_they_are_with_no_api_calls(bundle, tmp_path):
    certs.write(bundle, tmp_path)

    class NoApi:
        def __getattr__(self, name):
            raise AssertionError(f"--cert-dir must not call the API ({name})")

    ca, crt, key = await webhook.prepare_tls(args("--cert-dir", str(tmp_path)), NoApi())
    assert (ca, crt, key) == (tmp_path / "ca.crt", tmp_path / "tls.crt", tmp_path / "tls.key")
    (tmp_path / "ca.crt").unlink()
    assert (await webhook.prepare_tls(args("--cert-dir", str(tmp_path)), NoApi()))[0] is None


def test_flags_and_defaults_match_the_chart():
    a = parser().parse_args([])
    assert (a.webhook_port, a.webhook_host, a.webhook_failure_policy, a.cert_dir, a.no_webhook) == (
        9443, "0.0.0.0", None, None, False)
    assert (a.webhook_service, a.cert_secret) == ("vllmfit-webhook", "vllmfit-webhook-cert")
    assert (a.validating_webhook, a.mutating_webhook) == (NAMES["validating"], NAMES["mutating"])
    assert kmock  # the KMock pytest plugin is what provides the `kmock` fixture used above
