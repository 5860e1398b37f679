"""TLS client authentication of the API server (--webhook-client-ca, --webhook-client-name) over
real HTTPS: the operator's server (certificates from certs.py, or cert-manager's files) requires a
client certificate signed by the client CA, and with names, a subject CN or DNS SAN among them.

The client certificates are made here with `cryptography` (webhook_harness.client_cert), as an
administrator makes the one the API server's admission kubeconfig presents (docs/webhook.md).
"""

from __future__ import annotations

import argparse
import socket
import ssl
import time

import httpx
import kopf
import pytest
from webhook_harness import (
    FakeStore,
    Harness,
    admission_review,
    client_ca,
    client_cert,
    gfd_node,
    parser,
    vllmd,
)

from vllmfit.core.errors import UserError
from vllmfit.operator.admission import certs, webhook, webhookserver

MODEL_8B = "meta-llama/Llama-3.1-8B-Instruct"
NAMES = ("kube-apiserver", "apiserver.example.internal")
HANG_GUARD_S = 30


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The client CA the server trusts, another CA it does not, and a 'public' CA that the test
    process's default trust store (SSL_CERT_FILE) holds."""
    d = tmp_path_factory.mktemp("client-pki")
    ca_pem, signer = client_ca()
    (d / "client-ca.crt").write_bytes(ca_pem)
    public_pem, public = client_ca("a public CA in the system trust store")
    (d / "system-store.pem").write_bytes(public_pem)
    return {"dir": d, "ca_file": d / "client-ca.crt", "signer": signer, "other": client_ca("another CA")[1],
            "public": public, "system_store": d / "system-store.pem"}


@pytest.fixture(scope="module")
def server(pki):
    with pytest.MonkeyPatch.context() as mp:
        # a default trust store holding a CA that signs client certificates: the server must not
        # trust it (ssl.create_default_context(Purpose.CLIENT_AUTH), which Kopf uses, loads no
        # default CAs while verify_mode is CERT_NONE; this keeps it that way)
        mp.setenv("SSL_CERT_FILE", str(pki["system_store"]))
        args = ["--webhook-client-ca", str(pki["ca_file"])] + [a for n in NAMES for a in ("--webhook-client-name", n)]
        with Harness(FakeStore([gfd_node("gpu-node-a", 1)]), args) as h:
            yield h


def review_bytes() -> bytes:
    import json

    return json.dumps(admission_review(vllmd("fits", model=MODEL_8B, maxModelLen=8192))).encode()


def post(h, ctx: ssl.SSLContext) -> httpx.Response:
    with httpx.Client(base_url=h.url, verify=ctx, timeout=HANG_GUARD_S) as c:
        return c.post(f"/{webhook.VALIDATE_ID}", content=review_bytes(), headers={"Content-Type": "application/json"})


def exchange(h, ctx: ssl.SSLContext, request: bytes) -> bytes:
    """Send `request` over a new TLS connection; everything the server sends until it closes.
    b"" when the server refused the client during the handshake (TLS 1.3 clients learn that at
    their first read)."""
    raw = socket.create_connection(("127.0.0.1", h.port), timeout=HANG_GUARD_S)
    data = b""
    try:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(request)
            while chunk := s.recv(65536):
                data += chunk
    except (ssl.SSLError, ConnectionError):
        pass
    return data


def headers_only(content_length: int = 1000) -> bytes:
    """A request that announces a body and never sends it: answered at once only if it is refused
    before the body is read (else it would wait for the body and get 408)."""
    return (f"POST /{webhook.VALIDATE_ID} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n\r\n").encode()


def test_a_client_without_a_certificate_fails_the_handshake(server):
    assert exchange(server, server.ssl_context(), headers_only()) == b""
    with pytest.raises(httpx.TransportError):
        post(server, server.ssl_context())


def test_a_certificate_from_another_ca_fails_the_handshake(server, pki):
    cert = client_cert(pki["other"], pki["dir"] / "other", "kube-apiserver")
    assert exchange(server, server.ssl_context(cert), headers_only()) == b""
    with pytest.raises(httpx.TransportError):
        post(server, server.ssl_context(cert))


def test_a_certificate_from_the_system_trust_store_fails_the_handshake(server, pki):
    """The server trusts the client CA only, not the default trust store (SSL_CERT_FILE here)."""
    cert = client_cert(pki["public"], pki["dir"] / "public", "kube-apiserver")
    assert exchange(server, server.ssl_context(cert), headers_only()) == b""


@pytest.mark.parametrize(("cn", "dns"), [("kube-apiserver", ()), ("front-end", ("apiserver.example.internal",))])
def test_an_allowed_name_from_the_client_ca_gets_a_normal_review(server, pki, cn, dns):
    cert = client_cert(pki["signer"], pki["dir"] / "ok", cn, dns)
    r = post(server, server.ssl_context(cert))
    assert r.status_code == 200
    assert r.json()["response"]["allowed"] is True


def test_a_name_not_allowed_gets_403_with_one_line_before_anything_is_read(server, pki):
    cert = client_cert(pki["signer"], pki["dir"] / "bad", "system:node:gpu-node-a", ("gpu-node-a",))
    answer = exchange(server, server.ssl_context(cert), headers_only())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 ")
    message = body.decode()
    assert message == ("client certificate (CN=system:node:gpu-node-a, DNS:gpu-node-a) is not an allowed "
                       "API server name (--webhook-client-name)")
    r = post(server, server.ssl_context(cert))
    assert r.status_code == 403 and r.text == message
    # any path, any method: refused before routing
    with httpx.Client(base_url=server.url, verify=server.ssl_context(cert), timeout=HANG_GUARD_S) as c:
        assert c.get("/anything").status_code == 403


def test_client_name_problem():
    cert = {"subject": ((("organizationName", "system:masters"),), (("commonName", "kube-apiserver"),)),
            "subjectAltName": (("DNS", "apiserver.local"), ("IP Address", "10.0.0.1"))}
    assert webhookserver.client_name_problem(cert, ()) is None  # no names: any certificate the CA signed
    assert webhookserver.client_name_problem(cert, ["kube-apiserver"]) is None
    assert webhookserver.client_name_problem(cert, ["apiserver.local"]) is None
    assert webhookserver.client_name_problem(cert, ["10.0.0.1"]).startswith(
        "client certificate (CN=kube-apiserver, DNS:apiserver.local) is not")
    assert webhookserver.client_name_problem({}, ["x"]).startswith("no client certificate")
    long = {"subject": ((("commonName", "a\n" * 500),),)}
    message = webhookserver.client_name_problem(long, ["x"])
    assert "\n" not in message and len(message) < 300


def test_bad_flags_are_one_line_before_anything_starts(pki, tmp_path):
    def setup(*argv: str) -> None:
        webhook.setup(kopf.OperatorSettings(), parser().parse_args(list(argv)), FakeStore(),
                      registry=kopf.OperatorRegistry())

    with pytest.raises(UserError, match=r"^--webhook-client-name needs --webhook-client-ca"):
        setup("--webhook-client-name", "kube-apiserver")
    with pytest.raises(UserError, match=r"^--webhook-client-ca /nonexistent/ca.crt: No such file or directory$"):
        setup("--webhook-client-ca", "/nonexistent/ca.crt")
    (tmp_path / "not-a-ca.crt").write_text("hello\n")
    with pytest.raises(UserError, match=r"^--webhook-client-ca .*not-a-ca.crt: ") as e:
        setup("--webhook-client-ca", str(tmp_path / "not-a-ca.crt"))
    assert "\n" not in str(e.value)
    settings = kopf.OperatorSettings()
    webhook.setup(settings, parser().parse_args(["--webhook-client-ca", str(pki["ca_file"])]), FakeStore(),
                  registry=kopf.OperatorRegistry())
    s = settings.admission.server
    assert (s.verify_cafile, s.verify_mode, s.client_names) == (str(pki["ca_file"]), ssl.CERT_REQUIRED, ())
    plain = argparse.Namespace(webhook_host="0.0.0.0", webhook_port=9443)
    assert webhook.client_auth(plain) == {"client_ca": None, "client_names": []}


def test_cert_manager_mode_with_client_auth_and_a_rotated_client_ca(tmp_path, pki):
    """--cert-dir (cert-manager's Secret mount) and --webhook-client-ca together; the client CA is
    re-read when it changes in place, as a mounted ConfigMap does."""
    bundle = certs.generate("vllmfit-webhook", "vllmfit-system")
    certs.write(bundle, tmp_path / "serving")
    ca_file = tmp_path / "client-ca" / "ca.crt"
    ca_file.parent.mkdir()
    ca_file.write_bytes(pki["ca_file"].read_bytes())
    args = ["--cert-dir", str(tmp_path / "serving"), "--webhook-client-ca", str(ca_file),
            "--webhook-client-name", "kube-apiserver"]

    def context(cert=None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cadata=bundle.ca_crt.decode())
        if cert:
            ctx.load_cert_chain(*cert)
        return ctx

    with Harness(FakeStore([gfd_node("gpu-node-a", 1)]), args, file_check_interval=0.1) as h:
        ok = client_cert(pki["signer"], tmp_path / "c", "kube-apiserver")
        assert post(h, context(ok)).json()["response"]["allowed"] is True
        assert exchange(h, context(), headers_only()) == b""
        new_pem, new_signer = client_ca("the rotated client CA")
        ca_file.write_bytes(new_pem)
        rotated = client_cert(new_signer, tmp_path / "c", "kube-apiserver")
        for _ in range(100):  # re-read every file_check_interval; the listener restarts
            try:
                if post(h, context(rotated)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail("the rotated client CA was not loaded")
        assert exchange(h, context(ok), headers_only()) == b""  # the old CA is no longer trusted
