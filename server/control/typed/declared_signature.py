"""The I/O signature a model version declares when it is registered, checked and normalised.

Its tensors (name, wire datatype, dims without the batch dimension, an optional range) and, on an input
of one dimension, the ``features`` that name its elements: the fields of the model's typed API
(``server.control.typed.typed_schema``). The registry checks every registration with it
(``server.control.registry.registry``); the typed catalog reads a repository model's richer signature
with it (``server.control.typed.typed_catalog``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from server.control.typed.typed_schema import normalize_features
from server.errors import InvalidRequest

DATATYPES = {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES"}


def check_signature(signature: Mapping[str, Any]) -> dict:
    """The declared I/O signature, normalised: ``{"inputs": [...], "outputs": [...]}``.

    Each tensor: ``name``, ``datatype`` (wire name, e.g. FP32), ``dims`` (no batch dim; -1 is
    variable), optional ``range`` [lo, hi]; an input may name its ``features`` (one per element of
    its one dimension, each a name or ``{name, unit?, description?, range?, enum?}``: the fields of
    the model's typed API, ``server.control.typed.typed_schema``). An optional top-level
    ``max_batch_size`` is kept.
    """
    if not isinstance(signature, Mapping):
        raise InvalidRequest("the signature must be an object with 'inputs' and 'outputs'")
    out: dict[str, Any] = {}
    for side in ("inputs", "outputs"):
        tensors = signature.get(side)
        if not isinstance(tensors, list) or not tensors:
            raise InvalidRequest(f"the signature needs a non-empty '{side}' list")
        normalised = []
        for i, t in enumerate(tensors):
            where = f"signature {side}[{i}]"
            if not isinstance(t, Mapping) or not isinstance(t.get("name"), str) or not t["name"]:
                raise InvalidRequest(f"{where} needs a 'name'")
            datatype = str(t.get("datatype", "FP32")).upper()
            if datatype not in DATATYPES:
                raise InvalidRequest(f"{where} datatype {datatype!r} is not one of {sorted(DATATYPES)}")
            dims = t.get("dims")
            if not isinstance(dims, list) or not all(isinstance(d, int) and (d == -1 or d > 0) for d in dims):
                raise InvalidRequest(f"{where} dims must be a list of positive integers or -1")
            entry: dict[str, Any] = {"name": t["name"], "datatype": datatype, "dims": list(dims)}
            if t.get("range") is not None:
                lo, hi = (float(x) for x in t["range"])
                if lo > hi:
                    raise InvalidRequest(f"{where} range [{lo}, {hi}] is empty")
                entry["range"] = [lo, hi]
            if t.get("features") is not None:
                if side != "inputs":
                    raise InvalidRequest(f"{where}: only inputs declare features")
                entry["features"] = normalize_features(t["features"], entry, where)
            normalised.append(entry)
        out[side] = normalised
    if "max_batch_size" in signature:
        out["max_batch_size"] = int(signature["max_batch_size"])
    return out
