"""The frontend's zone on Kubernetes (issue 29): the init step reads its node's
``topology.kubernetes.io/zone`` label from an API server (here a real HTTP server on a socket,
answering as the API server does, and checking the bearer token) and writes it to the file the
frontend's settings read; a node without the label or an unreachable API writes no zone."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from server.runtime import node_zone
from server.settings import Settings

NODES = {"node-a": {"topology.kubernetes.io/zone": "eu-west-1a", "kubernetes.io/hostname": "node-a"}, "node-bare": {}}
TOKEN = "projected-token"


class _API(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        name = self.path.removeprefix("/api/v1/nodes/")
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._send(401, {"kind": "Status", "code": 401})
        if not self.path.startswith("/api/v1/nodes/") or name not in NODES:
            return self._send(404, {"kind": "Status", "code": 404})
        self._send(200, {"kind": "Node", "metadata": {"name": name, "labels": NODES[name]}})

    def _send(self, code, body):
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _API)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_zone_label_of_the_node_is_read_with_the_token(api):
    assert node_zone.node_zone("node-a", api=api, token=TOKEN) == "eu-west-1a"
    assert node_zone.node_zone("node-bare", api=api, token=TOKEN) == ""


def test_the_init_step_writes_the_zone_and_the_settings_read_it(api, tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    out = tmp_path / "zone" / "zone"
    assert node_zone.main(["--node", "node-a", "--out", str(out), "--api", api, "--token-dir", str(tmp_path)]) == 0
    assert out.read_text() == "eu-west-1a\n"
    assert Settings(zone_file=out).zone == "eu-west-1a"
    assert Settings(zone_file=out, zone="b").zone == "b"  # a zone given wins


@pytest.mark.parametrize("token, node", [("wrong", "node-a"), (TOKEN, "node-missing"), (TOKEN, "node-bare")])
def test_no_zone_is_written_when_the_api_refuses_or_the_node_has_no_label(api, tmp_path, token, node):
    (tmp_path / "token").write_text(token)
    out = tmp_path / "zone"
    assert node_zone.main(["--node", node, "--out", str(out), "--api", api, "--token-dir", str(tmp_path)]) == 0
    assert out.read_text() == "\n" and Settings(zone_file=out).zone == ""


def test_an_unreadable_zone_file_is_a_settings_error(tmp_path):
    with pytest.raises(ValueError, match="zone_file"):
        Settings(zone_file=tmp_path / "absent")
