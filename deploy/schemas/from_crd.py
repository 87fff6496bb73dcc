"""Turn a CustomResourceDefinition's published OpenAPI v3 schema into a strict JSON Schema.

    python deploy/schemas/from_crd.py CRD.yaml VERSION > deploy/schemas/KIND_GROUP_VERSION.json

What changes on the way (the structural-schema extensions Kubernetes applies, in JSON Schema terms):

- ``x-kubernetes-int-or-string: true`` becomes ``"type": ["integer", "string"]``;
- an object with ``properties`` and no ``additionalProperties`` rejects unknown fields
  (``additionalProperties: false``: the API server prunes them, we would rather be told), unless it
  says ``x-kubernetes-preserve-unknown-fields: true``;
- ``metadata`` takes ``name`` / ``namespace`` / ``labels`` / ``annotations`` (the CRD leaves it
  open, the API server checks it as ObjectMeta);
- descriptions are dropped (the vendored file stays small; read them in the CRD).

Only the standard library and PyYAML (a dependency of the ``kubernetes`` client).
"""

from __future__ import annotations

import json
import sys

import yaml

_META = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["name"],
}


def convert(node):
    if isinstance(node, list):
        return [convert(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("description", "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type"):
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: convert(sub) for name, sub in value.items()}
        elif key == "x-kubernetes-int-or-string":
            out.pop("type", None)
            out["type"] = ["integer", "string"]
        elif key == "x-kubernetes-preserve-unknown-fields":
            continue
        elif key == "x-kubernetes-validations":
            continue  # CEL rules: enforced by the API server, not expressible here
        else:
            out[key] = convert(value)
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def schema_for(crd: dict, version: str) -> dict:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = convert(v["schema"]["openAPIV3Schema"])
            break
    else:
        raise SystemExit(f"{crd['metadata']['name']} has no version {version}")
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"]["metadata"] = _META
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": f"{kind} {group}/{version}", **schema}


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    with open(argv[1]) as f:
        crd = next(d for d in yaml.safe_load_all(f) if d)
    json.dump(schema_for(crd, argv[2]), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv)
