"""Security on the real stack (issue 23): one frontend serving mutual TLS on every port with
certificates this module generates, tenants bound to certificate identities, safety filters on two
endpoints, payload logs sealed at rest, erasure by tenant and retention through the CLI.

Clients are the real ones: tritonclient grpc and http, the openai SDK, plain grpc stubs and
``ssl`` sockets. The last test greps everything the run printed or answered for its secrets.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography import x509

from server.cli.certs import issue, make_ca
from server.tenancy.store import TenancyStore
from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration

PEPPER = "pepper-do-not-leak-7c1e"
ENCRYPTION_KEY = base64.b64encode(b"K" * 16 + os.urandom(16)).decode()
ACME_ID = "spiffe://inferplane.test/tenant/acme"
BILLING_SUBJECT = "O=inferplane test,CN=billing-svc"  # bound in another attribute order than the certificate's
LLM, UNFILTERED, EMBED = "tiny_llama", "tiny_llama_budget", "minilm_embeddings"
REDACTING = "tiny_llama_redacting"  # the same weights again, its output's letter "a" redacted
BLOCKED_LETTER = "e"
SAFETY = {
    LLM: {
        "input": {"rules": [{"name": "deny", "kind": "keywords", "words": ["project zeus"], "action": "block"}]},
        "output": {"rules": [{"name": "no-e", "kind": "regex", "pattern": BLOCKED_LETTER, "action": "block"}]},
    },
    REDACTING: {"output": {"rules": [{"name": "no-a", "kind": "regex", "pattern": "a", "action": "redact"}]}},
    EMBED: {
        "input": {
            "rules": [{"name": "pii", "kind": "pii", "types": ["email"], "action": "redact"}],
            "classifier": {"model": "safety_classifier", "label": "unsafe", "threshold": 0.8, "action": "block"},
        }
    },
}
MARKER = "zebra-quartz-marker"  # a request text that must never be readable on disk


class PKI:
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca = make_ca("inferplane test CA")
        self.rogue = make_ca("rogue CA")
        self.ca_path = folder / "ca.crt"
        self.ca_path.write_bytes(self.ca.cert_pem)
        self.server_cert, self.server_key = issue(self.ca, "localhost", server=True).write(folder, "server")
        self.acme = issue(self.ca, "acme-client", uris=(ACME_ID,)).write(folder, "acme")
        self.billing = issue(self.ca, "billing-svc", org="inferplane test").write(folder, "billing")
        self.stranger = issue(self.ca, "stranger", uris=("spiffe://inferplane.test/nobody",)).write(folder, "stranger")
        self.expired = issue(self.ca, "acme-client", uris=(ACME_ID,), expired=True).write(folder, "expired")
        self.forged = issue(self.rogue, "acme-client", uris=(ACME_ID,)).write(folder, "forged")  # another CA signed it

    def context(self, client=None, ca=None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(ca or self.ca_path))
        if client is not None:
            ctx.load_cert_chain(*map(str, client))
        return ctx


def _cli(stack, *args, env=None):
    full = {**os.environ, **stack.cli_env, **(env or {})}
    out = subprocess.run([sys.executable, "-m", "server.cli.main", *args], capture_output=True, text=True, env=full, timeout=120)
    stack.outputs.append(out.stdout + out.stderr)
    return out


@pytest.fixture(scope="module")
def secure(llm_repository, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("secure")
    pki = PKI(workdir / "tls")
    repository = workdir / "model_repository"
    for name in (LLM, UNFILTERED, EMBED):  # hard links: the same weights, a config of our own
        shutil.copytree(llm_repository / name, repository / name, copy_function=os.link)
    from model_repository.config_writer import read_config, write_config
    from model_repository.safety_classifier import build_safety_classifier

    build_safety_classifier(repository)  # a model on the platform like any other (cached after the first build)

    shutil.copytree(llm_repository / UNFILTERED, repository / REDACTING, copy_function=os.link)
    config = read_config(repository / REDACTING)
    config.name = REDACTING
    (repository / REDACTING / "config.pbtxt").unlink()
    write_config(config, repository / REDACTING)
    config = read_config(repository / EMBED)
    config.parameters["inferplane.payload_log_sample"].string_value = "1.0"
    (repository / EMBED / "config.pbtxt").unlink()  # a hard link: write a new file, not through it
    write_config(config, repository / EMBED)

    url = f"sqlite:///{workdir}/inferplane.db"
    store = TenancyStore(url)
    key = store.create_key("keyed", PEPPER.encode(), models=["*"])[1]
    env = {
        "INFERPLANE_DATABASE_URL": url, "INFERPLANE_KEY_PEPPER": PEPPER, "INFERPLANE_DATA_DIR": str(workdir / "data"),
        "INFERPLANE_ENCRYPTION_KEY": ENCRYPTION_KEY,
    }  # fmt: skip
    from server.runtime.supervisor import free_port

    health_port = free_port()
    stack_env = {
        "INFERPLANE_HEALTH_PORT": str(health_port),
        **env, "INFERPLANE_AUTH": "on", "INFERPLANE_AUTH_REFRESH_S": "0.3", "INFERPLANE_TLS_RELOAD_S": "0.3",
        "INFERPLANE_SAFETY": json.dumps(SAFETY), "INFERPLANE_SAFETY_AUDIT_FLUSH_S": "0.3", "INFERPLANE_USAGE_FLUSH_S": "0.3",
    }  # fmt: skip
    stack = start_stack(
        repository, workdir, "--auth", "on", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca_path), env=stack_env,
    )  # fmt: skip
    stack.pki, stack.key, stack.store, stack.workdir, stack.outputs = pki, key, store, workdir, []
    stack.cli_env = env
    stack.health = f"127.0.0.1:{health_port}"
    for identity, tenant, models in ((ACME_ID, "acme", "*"), (BILLING_SUBJECT, "billing", EMBED)):
        out = _cli(stack, "tenants", "bind", identity, "--tenant", tenant, "--model", models)
        assert out.returncode == 0, out.stderr
    yield stack
    stop_stack(stack)


def _grpc_client(stack, client=None, ca=None):
    pki = stack.pki
    kwargs = {"root_certificates": str(ca or pki.ca_path)}
    if client is not None:
        kwargs.update(private_key=str(client[1]), certificate_chain=str(client[0]))
    return grpcclient.InferenceServerClient(stack.grpc, ssl=True, **kwargs)


def _text_input(text: str, lib=grpcclient):
    tensor = lib.InferInput("text", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return tensor


def _wait_bound(stack):
    """The frontend refreshes keys and bindings every 0.3 s: wait until both bound certificates (acme's,
    then billing's, bound one CLI call after the other) authenticate."""

    def ok(identity):
        client = _grpc_client(stack, identity)
        try:
            return client.is_model_ready(EMBED)
        except Exception:  # noqa: BLE001 - not bound yet
            return False
        finally:
            client.close()

    for identity in (stack.pki.acme, stack.pki.billing):
        wait_until(lambda: ok(identity), timeout=30, explain=lambda: stack.log_tail())


# ---- TLS and mTLS: the real clients ---------------------------------------------------------------


def test_tritonclient_grpc_authenticates_by_client_certificate(secure):
    _wait_bound(secure)
    client = _grpc_client(secure, secure.pki.acme)
    try:
        result = client.infer(EMBED, [_text_input("hello over mutual TLS")])
        assert result.as_numpy("embedding").shape == (1, 384)
        # the subject-bound tenant sees only what it was granted
        billing = _grpc_client(secure, secure.pki.billing)
        assert billing.infer(EMBED, [_text_input("billing hello")]).as_numpy("embedding").shape == (1, 384)
        with pytest.raises(Exception) as denied:
            billing.get_model_metadata(LLM)
        assert "tiny_llama" in str(denied.value)
        billing.close()
        # a certificate the CA signed but no tenant is bound to: a clear UNAUTHENTICATED, not a handshake error
        stranger = _grpc_client(secure, secure.pki.stranger)
        with pytest.raises(Exception) as unbound:
            stranger.infer(EMBED, [_text_input("who am I")])
        secure.outputs.append(str(unbound.value))
        assert "bound to no tenant" in str(unbound.value) and "spiffe://inferplane.test/nobody" in str(unbound.value)
        stranger.close()
    finally:
        client.close()


def test_tritonclient_http_over_mutual_tls(secure):
    _wait_bound(secure)
    pki = secure.pki
    client = httpclient.InferenceServerClient(
        secure.http, ssl=True, ssl_context_factory=lambda: pki.context(pki.acme),
    )  # fmt: skip
    try:
        assert client.is_server_ready()
        result = client.infer(EMBED, [_text_input("hello over https", httpclient)])
        assert result.as_numpy("embedding").shape == (1, 384)
    finally:
        client.close()


def _openai(secure, client_cert, key=None):
    pki = secure.pki
    http_client = openai.DefaultHttpxClient(verify=pki.context(client_cert))
    return openai.OpenAI(
        base_url=f"https://{secure.http.replace('127.0.0.1', 'localhost')}/v1", api_key=key or secure.key, max_retries=0, timeout=60, http_client=http_client,
    )  # fmt: skip


def test_openai_sdk_over_mutual_tls_with_an_api_key(secure):
    client = _openai(secure, secure.pki.stranger)  # the certificate passes the handshake; the key names the tenant
    try:
        assert {LLM, EMBED} <= {m.id for m in client.models.list().data}
        r = client.chat.completions.create(model=UNFILTERED, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1)
        assert r.choices[0].finish_reason in ("length", "stop")
    finally:
        client.close()


def _grpc_error(secure, credentials) -> tuple[grpc.StatusCode, str] | None:
    channel = grpc.secure_channel(secure.grpc, credentials, options=[("grpc.ssl_target_name_override", "localhost")])
    try:
        channel.unary_unary("/inference.GRPCInferenceService/ServerReady")(b"", timeout=20)
        return None
    except grpc.RpcError as err:
        return err.code(), err.details()
    finally:
        channel.close()


def _rest_get(secure, ctx) -> bytes:
    """The raw answer to one GET over a TLS connection made with ``ctx`` (b"": the server closed it)."""
    host, port = secure.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            chunks = []
            while chunk := tls.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)


def test_refused_handshakes_are_clear_errors_and_the_stack_keeps_serving(secure):
    pki = secure.pki
    read = lambda p: Path(p).read_bytes()  # noqa: E731
    ca = read(pki.ca_path)
    cases = {
        "a client that trusts another CA": grpc.ssl_channel_credentials(pki.rogue.cert_pem, read(pki.acme[1]), read(pki.acme[0])),
        "an expired client certificate": grpc.ssl_channel_credentials(ca, read(pki.expired[1]), read(pki.expired[0])),
        "a client certificate another CA signed": grpc.ssl_channel_credentials(ca, read(pki.forged[1]), read(pki.forged[0])),
        "no client certificate under mTLS": grpc.ssl_channel_credentials(ca),
    }
    for what, credentials in cases.items():
        err = _grpc_error(secure, credentials)
        assert err is not None and err[0] == grpc.StatusCode.UNAVAILABLE, f"{what}: {err}"
        secure.outputs.append(err[1])

    # REST: the client refuses a server its CA did not sign (a verification error naming the reason)
    rogue_ca = pki.folder / "rogue.crt"
    rogue_ca.write_bytes(pki.rogue.cert_pem)
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        _rest_get(secure, pki.context(pki.acme, ca=rogue_ca))
    # the server refuses an expired or forged client certificate in the handshake: nothing is answered
    for what, ctx in {"an expired client certificate": pki.context(pki.expired), "a forged one": pki.context(pki.forged)}.items():
        try:
            answer = _rest_get(secure, ctx)
        except (ssl.SSLError, ConnectionError) as err:
            answer = f"{type(err).__name__}: {err}".encode()
        assert not answer.startswith(b"HTTP/"), f"{what}: {answer[:80]!r}"
    # no client certificate: a 401 whose JSON body says what is missing
    answer = _rest_get(secure, pki.context())
    secure.outputs.append(answer.decode(errors="replace"))
    assert answer.startswith(b"HTTP/1.1 401"), answer[:80]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["code"] == "UNAUTHENTICATED" and "requires a client certificate" in body["error"]

    # plaintext to a TLS port: refused, nothing hangs, nothing crashes
    insecure = grpc.insecure_channel(secure.grpc)
    with pytest.raises(grpc.RpcError) as plain:
        insecure.unary_unary("/inference.GRPCInferenceService/ServerReady")(b"", timeout=20)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    insecure.close()
    host, port = secure.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert not raw.recv(4096).startswith(b"HTTP/1.1 200")

    assert _rest_get(secure, pki.context(pki.acme)).startswith(b"HTTP/1.1 200")  # still serving
    metrics = _https_get(secure, secure.metrics, "/metrics")
    assert "inferplane_" in metrics  # the metrics port serves mTLS too


def _https_get(secure, address: str, path: str, client=None) -> str:
    import http.client

    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPSConnection("localhost", int(port), context=secure.pki.context(client or secure.pki.acme), timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read().decode()
        assert r.status == 200, body[:200]
        return body
    finally:
        conn.close()


def test_the_plaintext_health_port_answers_probes_and_nothing_else(secure):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(secure.health) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as other:
            channel.unary_unary("/inference.GRPCInferenceService/ServerReady")(b"", timeout=10)
        assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _served_serial(secure, address: str, alpn: str) -> int:
    host, port = address.rsplit(":", 1)
    ctx = secure.pki.context(secure.pki.acme)
    ctx.set_alpn_protocols([alpn])
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def _serial_once_reloaded(secure, address: str, alpn: str) -> int | None:
    """The served serial while the server swaps its pair: a handshake cut by the swap is "not yet" (seen once in a
    module run: SSLEOFError), any other failure is the test's."""
    try:
        return _served_serial(secure, address, alpn)
    except ssl.SSLEOFError:
        return None


def test_a_renewed_server_certificate_is_served_without_a_restart(secure):
    pki = secure.pki
    old = x509.load_pem_x509_certificate(pki.server_cert.read_bytes()).serial_number
    assert _served_serial(secure, secure.http, "http/1.1") == old
    assert _served_serial(secure, secure.grpc, "h2") == old
    renewed = issue(pki.ca, "localhost", server=True)
    new = renewed.cert.serial_number
    tmp_cert, tmp_key = renewed.write(pki.folder, "renewed")
    os.replace(tmp_key, pki.server_key)  # the key first: in between the pair does not load and the old one keeps serving
    os.replace(tmp_cert, pki.server_cert)
    assert wait_until(lambda: _serial_once_reloaded(secure, secure.http, "http/1.1") == new, timeout=30)
    assert wait_until(lambda: _serial_once_reloaded(secure, secure.grpc, "h2") == new, timeout=30)
    client = _grpc_client(secure, pki.acme)  # and a real client still gets answers
    try:
        assert client.infer(EMBED, [_text_input("after the reload")]).as_numpy("embedding").shape == (1, 384)
    finally:
        client.close()


def test_the_clis_reach_a_mutual_tls_frontend_with_client_tls_settings(secure):
    _wait_bound(secure)
    pki = secure.pki
    url = secure.grpc.replace("127.0.0.1", "localhost")
    plain = _cli(secure, "endpoints", "list", "--url", url)
    assert plain.returncode != 0 and "UNAVAILABLE" in plain.stderr  # a plaintext client to the TLS port
    tls = {"INFERPLANE_CLIENT_TLS_CA": str(pki.ca_path), "INFERPLANE_CLIENT_TLS_CERT": str(pki.acme[0]), "INFERPLANE_CLIENT_TLS_KEY": str(pki.acme[1])}
    out = _cli(secure, "endpoints", "list", "--url", url, env=tls)
    assert out.returncode == 0, out.stderr
    assert EMBED in out.stdout and LLM in out.stdout  # acme (by its certificate) sees what it was granted


# ---- safety filters -------------------------------------------------------------------------------


def _stream(client, model, content, seed=7, max_tokens=48):
    parts, reasons = [], []
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, seed=seed, temperature=1.0, stream=True):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return "".join(parts), reasons


def test_a_blocked_stream_ends_with_content_filter_and_leaks_nothing(secure):
    client = _openai(secure, secure.pki.acme)
    try:
        unfiltered, _ = _stream(client, UNFILTERED, "tell me a story")  # the same weights, no policy
        assert BLOCKED_LETTER in unfiltered, f"pick another letter: the model said {unfiltered!r}"
        filtered, reasons = _stream(client, LLM, "tell me a story")
        assert reasons == ["content_filter"]
        assert BLOCKED_LETTER not in filtered
        assert unfiltered.startswith(filtered)  # what came out is the answer up to the match, nothing after it
    finally:
        client.close()


def test_a_redacting_output_filter_rewrites_the_stream_across_chunk_boundaries(secure):
    import re

    client = _openai(secure, secure.pki.acme)
    try:
        unfiltered, reasons = _stream(client, UNFILTERED, "tell me a story", max_tokens=64)
        assert "a" in unfiltered, f"pick another letter: the model said {unfiltered!r}"
        redacted, redacted_reasons = _stream(client, REDACTING, "tell me a story", max_tokens=64)
    finally:
        client.close()
    assert redacted == re.sub("a", "[REDACTED:regex]", unfiltered)  # every match, none leaked, nothing else changed
    assert redacted_reasons == reasons  # redaction does not end the stream


def test_grpc_generate_ends_a_blocked_stream_with_content_filter_and_refuses_raw_streams(secure):
    from server.protogen.inferplane.v1 import generate_pb2, generate_pb2_grpc

    pki = secure.pki
    read = lambda p: Path(p).read_bytes()  # noqa: E731
    credentials = grpc.ssl_channel_credentials(read(pki.ca_path), read(pki.acme[1]), read(pki.acme[0]))
    with grpc.secure_channel(secure.grpc, credentials, options=[("grpc.ssl_target_name_override", "localhost")]) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        def generate(model):
            request = generate_pb2.GenerateRequest(model=model, max_tokens=48, temperature=1.0, seed=7)
            request.messages.add(role="user", content="tell me a story")
            responses = list(stub.Generate(request, timeout=60))
            return "".join(r.text for r in responses), [r.finish_reason for r in responses if r.finish_reason]

        unfiltered, _ = generate(UNFILTERED)
        text, reasons = generate(LLM)
        assert reasons == ["content_filter"] and BLOCKED_LETTER not in text and unfiltered.startswith(text)
        # ModelStreamInfer passes Triton's bytes through unscreened: an endpoint with output filters refuses it
        client = _grpc_client(secure, pki.acme)
        errors = []
        client.start_stream(callback=lambda result, error: errors.append(error))
        try:
            prompt = grpcclient.InferInput("text_input", [1], "BYTES")
            prompt.set_data_from_numpy(np.array([b"hello"], dtype=object))
            client.async_stream_infer(LLM, [prompt])
            assert wait_until(lambda: errors, timeout=30)
        finally:
            client.stop_stream()
            client.close()
        assert errors[0] is not None and "filters its outputs" in str(errors[0]), errors


def test_a_blocked_prompt_is_a_400_naming_the_rule(secure):
    client = _openai(secure, secure.pki.acme)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=LLM, messages=[{"role": "user", "content": "status of Project Zeus?"}], max_tokens=4)
        secure.outputs.append(str(err.value))
        assert "rules: deny" in str(err.value) and err.value.code == "CONTENT_FILTER", (err.value.code, err.value.body)
    finally:
        client.close()

def test_a_redacted_input_is_what_the_model_sees(secure):
    grpc_client = _grpc_client(secure, secure.pki.acme)
    try:
        redacted = grpc_client.infer(EMBED, [_text_input("write to jane.doe@example.com today")]).as_numpy("embedding")
        expected = grpc_client.infer(EMBED, [_text_input("write to [REDACTED:email] today")]).as_numpy("embedding")
        unredacted = grpc_client.infer(EMBED, [_text_input("write to jane doe at example today")]).as_numpy("embedding")
    finally:
        grpc_client.close()
    assert np.allclose(redacted, expected, atol=1e-5)  # the model saw the redacted text
    assert not np.allclose(unredacted, expected, atol=1e-3)  # (a different text is a different vector)


def test_the_classifier_is_a_deployed_model_called_on_the_callers_behalf(secure):
    _wait_bound(secure)
    client = _grpc_client(secure, secure.pki.acme)
    try:
        assert client.is_model_ready("safety_classifier")
        direct = client.infer("safety_classifier", [_text_input("I will kill you tonight")]).as_numpy("probabilities")
        assert direct.reshape(-1)[1] > 0.8  # the deployed model itself calls it unsafe
        with pytest.raises(Exception) as blocked:
            client.infer(EMBED, [_text_input("I will kill you tonight")])
        secure.outputs.append(str(blocked.value))
        assert "INVALID_ARGUMENT" in str(blocked.value) and "safety_classifier" in str(blocked.value)
        ok = client.infer(EMBED, [_text_input("how do I kill the process that hangs my build")])  # a hard negative
        assert ok.as_numpy("embedding").shape == (1, 384)
    finally:
        client.close()

    def classifier_usage():  # metered like any request, to the caller's tenant
        import sqlalchemy as sa

        engine = sa.create_engine(secure.cli_env["INFERPLANE_DATABASE_URL"])
        try:
            with engine.connect() as conn:
                q = sa.text("select tenant, sum(requests) from tenancy_usage where model = 'safety_classifier' group by tenant")
                return dict(conn.execute(q).all())
        finally:
            engine.dispose()

    wait_until(lambda: classifier_usage().get("acme", 0) >= 3, timeout=30, explain=lambda: classifier_usage())


def test_decisions_are_metered_and_audited(secure):
    def audit_rows():
        import sqlalchemy as sa

        engine = sa.create_engine(secure.cli_env["INFERPLANE_DATABASE_URL"])
        try:
            with engine.connect() as conn:
                return [dict(r._mapping) for r in conn.execute(sa.text("select actor, action, target, detail from audit_log"))]
        finally:
            engine.dispose()

    wait_until(lambda: {"safety.block", "safety.redact"} <= {r["action"] for r in audit_rows()}, timeout=30, explain=lambda: audit_rows())
    for row in audit_rows():
        assert "Zeus" not in (row["detail"] or "") and "jane.doe" not in (row["detail"] or "")  # never the text
    metrics = _https_get(secure, secure.metrics, "/metrics")
    secure.outputs.append(metrics)
    decided = [line for line in metrics.splitlines() if line.startswith("inferplane_safety_decisions_total{")]
    assert any('action="block"' in line and LLM in line for line in decided), decided
    assert any('action="redact"' in line and EMBED in line for line in decided), decided


# ---- encryption at rest, erasure, retention ----------------------------------------------------------


def _payload_files(secure) -> list[Path]:
    return sorted((secure.workdir / "data" / "payloads").glob("payloads-*.jsonl"))


def _records(secure, tenant=None) -> list[dict]:
    from server.control.registry.envelope import KeyRing
    from server.control.registry.records import RecordFiles

    return list(RecordFiles(str(secure.workdir / "data" / "payloads"), "payloads-", KeyRing.parse(ENCRYPTION_KEY)).read(tenant))


def test_payload_logs_are_sealed_at_rest_and_erased_by_tenant(secure):
    _wait_bound(secure)
    client = _grpc_client(secure, secure.pki.acme)
    try:
        client.infer(EMBED, [_text_input(f"acme {MARKER}")])
        client.infer(EMBED, [_text_input(f"keyed {MARKER}")], headers={"authorization": f"Bearer {secure.key}"})
    finally:
        client.close()

    def logged():
        tenants = {r.get("tenant") for r in _records(secure) if MARKER in json.dumps(r)}
        return {"acme", "keyed"} <= tenants

    wait_until(logged, timeout=30, explain=lambda: _records(secure))
    on_disk = b"".join(p.read_bytes() for p in _payload_files(secure))
    assert MARKER.encode() not in on_disk and b"acme " not in on_disk  # sealed: only ts and tenant are clear

    out = _cli(secure, "data", "purge", "--tenant", "acme", "--actor", "dpo@example.test")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["deleted"]["payload_logs"] >= 1
    assert _records(secure, "acme") == []
    assert _records(secure, "keyed")  # another tenant's records stay
    rows = _audit(secure, "data.purge")
    assert rows and rows[-1]["actor"] == "dpo@example.test" and rows[-1]["target"] == "tenant:acme"

    out = _cli(secure, "data", "retention", env={"INFERPLANE_RETENTION_DAYS": json.dumps({"payload_logs": 1e-9})})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["payload_logs"]["deleted"] >= 1
    assert _records(secure) == []
    assert _audit(secure, "retention.purge")


def _audit(secure, action):
    import sqlalchemy as sa

    engine = sa.create_engine(secure.cli_env["INFERPLANE_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            q = sa.text("select actor, action, target, outcome, detail from audit_log where action = :a order by id")
            return [dict(r._mapping) for r in conn.execute(q, {"a": action})]
    finally:
        engine.dispose()


# ---- secrets hygiene: last, over everything the module saw -------------------------------------------


def test_no_secret_appears_in_any_output(secure):
    secure.outputs.append(_https_get(secure, secure.metrics, "/metrics"))
    for path in ("/v2", "/v2/health/ready", "/v1/models"):
        try:
            secure.outputs.append(_https_get(secure, secure.http, path))
        except AssertionError as err:
            secure.outputs.append(str(err))
    secure.outputs.append(secure.log_tail(100000))
    for log in secure.workdir.rglob("*.log"):
        secure.outputs.append(log.read_text(errors="replace"))
    key_body = "".join(secure.pki.server_key.read_text().splitlines()[1:-1])[:40]
    secrets = {"pepper": PEPPER, "encryption key": ENCRYPTION_KEY, "api key": secure.key, "api key secret part": secure.key.removeprefix("ipk_").partition("_")[2], "tls key": key_body}
    text = "\n".join(secure.outputs)
    assert len(text) > 1000  # there was something to look through
    for what, secret in secrets.items():
        assert secret not in text, f"the {what} appears in an output"


# ---- the frontend -> remote Triton channel over mutual TLS ----------------------------------------------


@pytest.fixture(scope="module")
def tls_triton(secure, tmp_path_factory):
    """A tritonserver of its own that speaks only mutual TLS on gRPC (its own certificates, its own CA)."""
    from server.runtime.supervisor import free_port
    from server.runtime.triton_install import TritonInstallation

    workdir = tmp_path_factory.mktemp("tls_triton")
    ca = make_ca("triton CA")
    (workdir / "triton-ca.crt").write_bytes(ca.cert_pem)
    cert, key = issue(ca, "triton.internal", server=True, hosts=("triton.internal",)).write(workdir, "triton")
    frontend = issue(ca, "inferplane-frontend").write(workdir, "frontend")
    install = TritonInstallation.find()
    port = free_port()
    args = [
        str(install.binary), f"--model-repository={secure.repository}", "--model-control-mode=explicit", "--disable-auto-complete-config",
        f"--backend-directory={install.prepare_backends(workdir)}", f"--cache-directory={install.caches}",
        "--allow-http=false", "--allow-metrics=false", "--grpc-address=127.0.0.1", f"--grpc-port={port}",
        "--grpc-use-ssl=true", "--grpc-use-ssl-mutual=true", f"--grpc-server-cert={cert}", f"--grpc-server-key={key}",
        f"--grpc-root-cert={workdir / 'triton-ca.crt'}", f"--load-model={EMBED}",
    ]  # fmt: skip
    log = open(workdir / "triton.log", "wb")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(args, env=install.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    creds = dict(root_certificates=str(workdir / "triton-ca.crt"), private_key=str(frontend[1]), certificate_chain=str(frontend[0]))

    def live():
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}", ssl=True, channel_args=[("grpc.ssl_target_name_override", "triton.internal")], **creds)
        try:
            return client.is_model_ready(EMBED)
        except Exception:  # noqa: BLE001 - still starting
            return False
        finally:
            client.close()

    try:
        wait_until(live, timeout=120, interval=0.5, explain=lambda: (workdir / "triton.log").read_text(errors="replace")[-3000:])
        yield {"url": f"127.0.0.1:{port}", "ca": workdir / "triton-ca.crt", "cert": frontend[0], "key": frontend[1], "workdir": workdir}
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
        log.close()


def test_the_frontend_talks_to_a_remote_triton_over_mutual_tls(secure, tls_triton):
    from loadtest.stack import start_stack as raw_start

    workdir = tls_triton["workdir"]
    env = {
        "INFERPLANE_AUTH": "off", "INFERPLANE_DATABASE_URL": f"sqlite:///{workdir}/frontend.db", "INFERPLANE_DATA_DIR": str(workdir / "data"),
        "INFERPLANE_TRITON_TLS_CA": str(tls_triton["ca"]), "INFERPLANE_TRITON_TLS_CERT": str(tls_triton["cert"]),
        "INFERPLANE_TRITON_TLS_KEY": str(tls_triton["key"]), "INFERPLANE_TRITON_TLS_SERVER_NAME": "triton.internal",
    }  # fmt: skip
    stack = raw_start(secure.repository, workdir / "frontend", "--triton-url", tls_triton["url"], env=env)
    try:
        client = grpcclient.InferenceServerClient(stack.grpc)  # the frontend's own port: plaintext here
        try:
            result = client.infer(EMBED, [_text_input("through a TLS channel to Triton")])
            assert result.as_numpy("embedding").shape == (1, 384)
        finally:
            client.close()
    finally:
        stop_stack(stack)
    # without the client certificate Triton refuses the channel, and the frontend says so
    plain = {k: v for k, v in env.items() if not k.startswith("INFERPLANE_TRITON_TLS_")}
    with pytest.raises(RuntimeError) as refused:
        raw_start(secure.repository, workdir / "plain", "--triton-url", tls_triton["url"], env=plain)
    secure.outputs.append(str(refused.value))
    assert f"the Triton at {tls_triton['url']}: if it serves TLS, set INFERPLANE_TRITON_TLS_CA" in str(refused.value), str(refused.value)[-2000:]
    assert "Traceback" not in str(refused.value)
