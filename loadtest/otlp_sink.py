"""A real OTLP/HTTP trace receiver (for the tests and the tracing benchmark): a loopback HTTP server on a free port that decodes each
``POST /v1/traces`` body as the OTLP protobuf ``ExportTraceServiceRequest`` (opentelemetry-proto) and
keeps the spans, with their service name. Both the frontend's exporter and Triton's OpenTelemetry
trace mode (opentelemetry-cpp's OTLP/HTTP exporter) send here."""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    links: list[tuple[str, str]]
    start_ns: int
    end_ns: int
    status_code: int


@dataclass
class Receiver:
    server: ThreadingHTTPServer
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    content_types: set = field(default_factory=set)
    bad: list = field(default_factory=list)  # bodies that did not decode (headers, first bytes)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def by_trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in list(self.spans) if s.trace_id == trace_id]


_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _from_json(body: bytes) -> trace_service_pb2.ExportTraceServiceRequest:
    """OTLP/JSON is the protobuf JSON mapping except that ids are hex, not base64 (the OTLP spec)."""
    import base64
    import json

    from google.protobuf import json_format

    def fix(node):
        if isinstance(node, dict):
            return {k: (base64.b64encode(bytes.fromhex(v)).decode() if k in _ID_KEYS and isinstance(v, str) else fix(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    return json_format.ParseDict(fix(json.loads(body)), trace_service_pb2.ExportTraceServiceRequest(), ignore_unknown_fields=True)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def start_receiver() -> Receiver:
    lock = threading.Lock()
    holder: dict = {}

    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1 keep-alive: opentelemetry-cpp (Triton) reuses its connection; an HTTP/1.0 server closes
        # each one after the reply, and an export sent on a connection that is being closed is lost
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):  # noqa: N802 - /stats: how many spans arrived (for a sink in another process)
            body = json.dumps({"spans": len(holder["r"].spans), "requests": holder["r"].requests}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802 - http.server's name
            if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":  # opentelemetry-cpp (Triton) sends chunks
                body = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if not size:
                        self.rfile.readline()
                        break
                    body += self.rfile.read(size)
                    self.rfile.readline()
            else:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            encoding = (self.headers.get("Content-Encoding") or "").lower()
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            receiver: Receiver = holder["r"]
            if self.path != "/v1/traces":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            try:
                if (self.headers.get("Content-Type") or "").startswith("application/json"):
                    request = _from_json(body)  # Triton's opentelemetry-cpp exporter sends OTLP/JSON
                else:
                    request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            except Exception:
                receiver.bad.append((dict(self.headers), body[:200]))
                self.send_response(400)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            spans = []
            for resource_spans in request.resource_spans:
                attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                service = attrs.get("service.name", "")
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        spans.append(ReceivedSpan(
                            service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                            {a.key: _value(a.value) for a in s.attributes},
                            [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            s.start_time_unix_nano, s.end_time_unix_nano, s.status.code,
                        ))  # fmt: skip
            with lock:
                receiver.spans.extend(spans)
                receiver.requests += 1
                receiver.content_types.add(self.headers.get("Content-Type"))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = holder["r"] = Receiver(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver


if __name__ == "__main__":  # a sink in a process of its own (the benchmark's): prints "PORT n", serves until killed
    import time

    r = start_receiver()
    print(f"PORT {r.server.server_address[1]}", flush=True)
    while True:
        time.sleep(3600)
