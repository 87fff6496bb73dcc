"""The zone of the node a pod runs on (issue 29), for the frontend's ``--zone`` on Kubernetes.

The downward API exposes a pod's own fields and labels, not its node's, so the frontend pod's init
container runs ``python -m server.runtime.node_zone --node $(NODE_NAME) --out FILE``: it reads its
node (``NODE_NAME``: the downward API's ``spec.nodeName``) from the API server —
``GET /api/v1/nodes/NAME``, granted by the ClusterRole ``inferplane-read-nodes`` (get nodes, nothing
else) — with a service-account token projected into the init container alone (the frontend
container itself has no token), and writes the node's ``topology.kubernetes.io/zone`` label to the
file. The frontend reads it (``INFERPLANE_ZONE_FILE``) when ``INFERPLANE_ZONE`` is not given. A node
without the label, or an API server that does not answer, writes an empty zone: the frontend then
routes without locality rather than not starting.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ZONE_LABEL = "topology.kubernetes.io/zone"
TOKEN_DIR = Path("/var/run/secrets/inferplane/node-reader")  # the projected token and CA (deploy/base/frontend)
IN_CLUSTER_API = "https://kubernetes.default.svc"


def node_zone(node: str, *, api: str, token: str, ca_file: Path | None = None, timeout: float = 5.0) -> str:
    """The node's zone label ('' when it has none)."""
    url = f"{api.rstrip('/')}/api/v1/nodes/{urllib.parse.quote(node, safe='')}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None and url.startswith("https:") else None
    with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
        labels = json.loads(answer.read()).get("metadata", {}).get("labels", {}) or {}
    return str(labels.get(ZONE_LABEL, ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", default="", help="the node's name (the manifest passes $(NODE_NAME): fieldRef spec.nodeName)")
    parser.add_argument("--out", type=Path, required=True, help="the file to write the zone to")
    parser.add_argument("--api", default=IN_CLUSTER_API, help="the API server [default: the in-cluster Service]")
    parser.add_argument("--token-dir", type=Path, default=TOKEN_DIR, help="holds token and ca.crt")
    args = parser.parse_args(argv)
    zone = ""
    try:
        if not args.node:
            raise RuntimeError("no node name: give --node (fieldRef spec.nodeName)")
        ca = args.token_dir / "ca.crt"
        zone = node_zone(
            args.node, api=args.api, token=(args.token_dir / "token").read_text().strip(), ca_file=ca if ca.exists() else None
        )  # fmt: skip
        if not zone:
            print(f"node {args.node} has no {ZONE_LABEL} label: no zone", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - a frontend without a zone still serves
        print(f"reading the zone of node {args.node or '?'} failed ({type(err).__name__}: {err}): no zone", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(zone + "\n")
    print(f"zone {zone or '(none)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
