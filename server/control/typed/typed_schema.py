"""Typed per-model APIs: a model's signature becomes a protobuf schema (``.proto`` text and descriptor).

Pure functions of the registry's JSON signature (``{"inputs": [...], "outputs": [...]}``, see
``server.control.typed.declared_signature.check_signature``) or of the data plane's ``ModelSignature``:

* a tabular input with declared ``features`` becomes one field per feature, in order (a feature
  may carry a ``unit``, a ``description``, a ``range`` [lo, hi] or an ``enum`` of labels);
* an input without features becomes one field named after the tensor: a scalar for one element,
  ``string`` for a BYTES element (a text model's ``string text``), ``repeated`` (packed) otherwise;
* every output becomes one field named after the tensor the same way.

For model ``fraud_xgboost`` at schema major 1 the file is package
``inferplane.models.fraud_xgboost.v1`` with ``FraudXgboostRequest`` / ``FraudXgboostResponse``,
``FraudXgboostRow`` / ``FraudXgboostBatchRequest {repeated FraudXgboostRow rows}`` /
``FraudXgboostBatchResponse {repeated FraudXgboostResponse results}`` and
``FraudXgboostService { Predict, PredictBatch }``. Input fields are proto3 ``optional`` (so a
missing one is told from a zero); an enum's 0 is ``<NAME>_UNSPECIFIED`` and its labels are 1, 2, …
in declaration order, each standing for a tensor value (the label's index unless declared).

The ``.proto`` text and its descriptor are written by ``server.control.typed.typed_proto``; the
compatibility check between the schema being served and a new one is ``server.control.typed.typed_compat``.
"""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from server.dataplane.signature import is_llm
from server.errors import InvalidRequest

IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PACKAGE_ROOT = "inferplane.models"

# wire datatype -> proto scalar type of a field carrying one element
PROTO_TYPE = {
    "FP32": "float", "FP16": "float", "FP64": "double",
    "INT8": "int32", "INT16": "int32", "INT32": "int32", "INT64": "int64",
    "UINT8": "uint32", "UINT16": "uint32", "UINT32": "uint32", "UINT64": "uint64",
    "BOOL": "bool", "BYTES": "string",
}  # fmt: skip
# values a narrow integer tensor can hold (the proto field is wider)
INT_BOUNDS = {"INT8": (-(2**7), 2**7 - 1), "INT16": (-(2**15), 2**15 - 1), "UINT8": (0, 2**8 - 1), "UINT16": (0, 2**16 - 1)}
# field names the generated message code of common languages reserves or that read badly
_RESERVED = {"descriptor", "extensions"}


class NoTypedApi(Exception):
    """The model's signature has no typed form (an LLM, a variable multi-dimensional tensor, BF16)."""


# ---- the schema ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field of the request (or response) message, and where its value lives in a tensor."""

    name: str
    number: int
    type: str  # a proto scalar ("float", "string", ...) or, with ``enum``, the enum type's name
    tensor: str
    index: int | None = None  # position of a feature in the tensor's row; None: the field is the whole tensor
    repeated: bool = False
    count: int | None = None  # elements of a repeated field (None: any number)
    required: bool = True  # inputs only: the field must be present
    enum: tuple[tuple[str, float], ...] = ()  # labels (proto numbers 1, 2, ...) and their tensor values
    range: tuple[float, float] | None = None
    unit: str = ""
    description: str = ""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "number": self.number, "type": self.type, "tensor": self.tensor}
        for key in ("index", "count", "range"):
            if getattr(self, key) is not None:
                out[key] = list(self.range) if key == "range" else getattr(self, key)
        if self.repeated:
            out["repeated"] = True
        if not self.required:
            out["required"] = False
        if self.enum:
            out["enum"] = [[label, value] for label, value in self.enum]
        for key in ("unit", "description"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Field":
        return cls(
            name=d["name"], number=int(d["number"]), type=d["type"], tensor=d["tensor"], index=d.get("index"),
            repeated=bool(d.get("repeated", False)), count=d.get("count"), required=bool(d.get("required", True)),
            enum=tuple((str(label), float(value)) for label, value in d.get("enum", ())),
            range=tuple(d["range"]) if d.get("range") is not None else None,
            unit=d.get("unit", ""), description=d.get("description", ""),
        )  # fmt: skip


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dimension
    fields: tuple[Field, ...]
    optional: bool = False

    @property
    def tabular(self) -> bool:
        """Its fields are features: one element of the row each."""
        return bool(self.fields) and self.fields[0].index is not None

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "datatype": self.datatype, "dims": list(self.dims), "fields": [f.as_dict() for f in self.fields]}
        if self.optional:
            out["optional"] = True
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Tensor":
        return cls(d["name"], d["datatype"], tuple(d["dims"]), tuple(Field.from_dict(f) for f in d["fields"]), bool(d.get("optional", False)))


@dataclass(frozen=True)
class TypedSchema:
    model: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    major: int = 1
    revision: int = 0  # non-breaking changes applied to this major
    model_version: str = ""  # the model version it was derived from ("" when unknown)

    # -- names --
    @property
    def stem(self) -> str:
        return camel(self.model)

    @property
    def package(self) -> str:
        return f"{PACKAGE_ROOT}.{package_part(self.model)}.v{self.major}"

    @property
    def service(self) -> str:
        return f"{self.package}.{self.stem}Service"

    @property
    def file_name(self) -> str:
        part = package_part(self.model)
        return f"inferplane/models/{part}/v{self.major}/{part}.proto"

    def message(self, kind: str) -> str:
        """``Request``, ``Response``, ``Row``, ``BatchRequest`` or ``BatchResponse`` -> its full name."""
        return f"{self.package}.{self.stem}{kind}"

    @property
    def request_fields(self) -> tuple[Field, ...]:
        return tuple(f for t in self.inputs for f in t.fields)

    @property
    def response_fields(self) -> tuple[Field, ...]:
        return tuple(f for t in self.outputs for f in t.fields)

    def enums(self) -> list[tuple[str, Field]]:
        return [(enum_type(f), f) for f in self.request_fields if f.enum]

    # -- persistence --
    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "major": self.major, "revision": self.revision, "model_version": self.model_version,
            "inputs": [t.as_dict() for t in self.inputs], "outputs": [t.as_dict() for t in self.outputs],
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TypedSchema":
        return cls(
            model=d["model"], inputs=tuple(Tensor.from_dict(t) for t in d["inputs"]),
            outputs=tuple(Tensor.from_dict(t) for t in d["outputs"]), major=int(d.get("major", 1)),
            revision=int(d.get("revision", 0)), model_version=str(d.get("model_version", "")),
        )  # fmt: skip

    def with_version(self, major: int, revision: int = 0, model_version: str | None = None) -> "TypedSchema":
        return replace(self, major=major, revision=revision, model_version=self.model_version if model_version is None else model_version)

    @property
    def label(self) -> str:
        return f"v{self.major}" + (f".{self.revision}" if self.revision else "")


# ---- names -----------------------------------------------------------------------------------


def camel(name: str) -> str:
    """``fraud_xgboost`` -> ``FraudXgboost`` (a message-name stem; digits first get an ``M``)."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name) if w]
    stem = "".join(w[:1].upper() + w[1:] for w in words) or "Model"
    return stem if stem[0].isalpha() else "M" + stem


def package_part(name: str) -> str:
    """A model name as one lowercase package component (``my-model.v2`` -> ``my_model_v2``)."""
    part = re.sub(r"[^a-z0-9_]", "_", name.lower())
    return part if part[:1].isalpha() else "m_" + part


def json_name(name: str) -> str:
    """protoc's lowerCamelCase JSON name of a field."""
    out, upper = [], False
    for ch in name:
        if ch == "_":
            upper = True
        else:
            out.append(ch.upper() if upper else ch)
            upper = False
    return "".join(out)


def enum_type(f: Field) -> str:
    return f.type


def enum_prefix(f: Field) -> str:
    return f.name.upper()


def _field_name(tensor_name: str, taken: set[str]) -> str:
    """A tensor name as a field name: invalid characters become ``_``; a clash gets a suffix."""
    base = re.sub(r"[^A-Za-z0-9_]", "_", tensor_name) or "value"
    if not IDENT.match(base):
        base = "t_" + base
    name, n = base, 2
    while _json_key(name) in taken:
        name, n = f"{base}_{n}", n + 1
    return name


def _json_key(name: str) -> str:
    """What two field names must not share: protoc refuses fields whose JSON names clash."""
    return json_name(name).lower()


# ---- features: what the registry checks at registration ------------------------------------


def normalize_features(features: Any, tensor: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """Check and normalise a tabular input's ``features`` declaration.

    Each feature is a name or ``{"name", "unit"?, "description"?, "range"? [lo, hi], "enum"?}``;
    ``enum`` is a list of labels (tensor values 0, 1, ...) or an object label -> tensor value.
    The count must equal the input's one fixed dimension; names are protobuf identifiers, unique
    (also as protobuf JSON names).
    """
    if not isinstance(features, list) or not features:
        raise InvalidRequest(f"{where} features must be a non-empty list")
    dims = tensor.get("dims") or []
    datatype = tensor.get("datatype", "FP32")
    if len(dims) != 1 or dims[0] == -1:
        raise InvalidRequest(f"{where} features need a tensor of one fixed dimension [N], got dims {list(dims)}")
    if len(features) != dims[0]:
        raise InvalidRequest(f"{where} declares {len(features)} features for a feature dimension of {dims[0]}")
    if datatype not in PROTO_TYPE or datatype == "BYTES":
        raise InvalidRequest(f"{where} features need a numeric or BOOL tensor, got {datatype}")
    out: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for i, item in enumerate(features):
        at = f"{where} features[{i}]"
        feature = {"name": item} if isinstance(item, str) else item
        if not isinstance(feature, Mapping) or not isinstance(feature.get("name"), str):
            raise InvalidRequest(f"{at} must be a name or an object with a 'name'")
        name = feature["name"]
        check_identifier(name, at)
        key = _json_key(name)
        if key in seen:
            raise InvalidRequest(f"{at} name '{name}' clashes with '{seen[key]}' (names must be unique, also as protobuf JSON names)")
        seen[key] = name
        entry: dict[str, Any] = {"name": name}
        for text in ("unit", "description"):
            if feature.get(text) is not None:
                if not isinstance(feature[text], str):
                    raise InvalidRequest(f"{at} {text} must be a string")
                entry[text] = feature[text].replace("\n", " ")[:200]
        if feature.get("range") is not None:
            entry["range"] = _range(feature["range"], at)
        if feature.get("enum") is not None:
            if "range" in entry:
                raise InvalidRequest(f"{at} is either an enum or has a range, not both")
            if datatype == "BOOL":
                raise InvalidRequest(f"{at} a BOOL feature cannot be an enum")
            entry["enum"] = _enum(feature["enum"], at)
        out.append(entry)
    return out


def check_identifier(name: str, where: str) -> None:
    if not IDENT.match(name):
        raise InvalidRequest(f"{where} name {name!r} is not a protobuf identifier (a letter or '_', then letters, digits, '_')")
    if name in _RESERVED or keyword.iskeyword(name):
        raise InvalidRequest(f"{where} name {name!r} is reserved in generated code; choose another")


def _range(value: Any, where: str) -> list[float]:
    try:
        lo, hi = (float(x) for x in value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"{where} range must be [lo, hi]") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise InvalidRequest(f"{where} range [{lo}, {hi}] is empty")
    return [lo, hi]


def _enum(value: Any, where: str) -> list[list[Any]]:
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        pairs = [(label, float(i)) for i, label in enumerate(value)]
    elif isinstance(value, list) and all(isinstance(v, list | tuple) and len(v) == 2 for v in value):
        pairs = [(label, v) for label, v in value]
    else:
        raise InvalidRequest(f"{where} enum must be a list of labels or an object label -> value")
    if not pairs:
        raise InvalidRequest(f"{where} enum has no labels")
    labels: set[str] = set()
    values: set[float] = set()
    out = []
    for label, v in pairs:
        if not isinstance(label, str) or not IDENT.match(label):
            raise InvalidRequest(f"{where} enum label {label!r} is not a protobuf identifier")
        if label.upper() in labels or label.upper() == "UNSPECIFIED":
            raise InvalidRequest(f"{where} enum label {label!r} is repeated or reserved (UNSPECIFIED is the unset value)")
        try:
            number = float(v)
        except (TypeError, ValueError):
            raise InvalidRequest(f"{where} enum value of {label!r} must be a number") from None
        if number in values or not math.isfinite(number):
            raise InvalidRequest(f"{where} enum value {v!r} of {label!r} is repeated or not finite")
        labels.add(label.upper())
        values.add(number)
        out.append([label, number])
    return out


def check_declared(model: str, signature: Mapping[str, Any]) -> None:
    """Refuse a normalised signature whose feature names cannot make the typed API (clashes across
    inputs, with the outputs' message names, or an enum type named like a message)."""
    try:
        from_signature(model, signature)
    except NoTypedApi:
        return  # no typed form at all: nothing declared can be wrong with it


# ---- derivation ------------------------------------------------------------------------------


def from_signature(model: str, signature: Mapping[str, Any], *, model_version: str = "", optional_inputs=()) -> TypedSchema:
    """The typed schema of a (normalised) JSON signature; ``NoTypedApi`` when it has none."""
    taken: set[str] = set()
    number = 0
    inputs = []
    for t in signature["inputs"]:
        dims = tuple(int(d) for d in t["dims"])
        datatype = t["datatype"]
        optional = t["name"] in optional_inputs or bool(t.get("optional", False))
        if datatype not in PROTO_TYPE:
            raise NoTypedApi(f"input '{t['name']}' is {datatype}, which has no protobuf field type")
        fields = []
        if t.get("features"):
            for index, feat in enumerate(t["features"]):
                name = feat["name"]
                if _json_key(name) in taken:
                    raise InvalidRequest(f"feature '{name}' of input '{t['name']}' clashes with another field of the request")
                taken.add(_json_key(name))
                number += 1
                kind = camel(name) if feat.get("enum") else PROTO_TYPE[datatype]
                fields.append(
                    Field(
                        name=name, number=number, type=kind, tensor=t["name"], index=index, required=not optional,
                        enum=tuple((str(label), float(v)) for label, v in feat.get("enum", ())),
                        range=tuple(feat["range"]) if feat.get("range") is not None else None,
                        unit=feat.get("unit", ""), description=feat.get("description", ""),
                    )  # fmt: skip
                )
        else:
            name = _field_name(t["name"], taken)
            taken.add(_json_key(name))
            number += 1
            fields.append(_tensor_field(name, number, t["name"], datatype, dims, "input", required=not optional, range_=t.get("range")))
        inputs.append(Tensor(t["name"], datatype, dims, tuple(fields), optional))
    outputs = []
    taken, number = set(), 0
    for t in signature["outputs"]:
        dims = tuple(int(d) for d in t["dims"])
        if t["datatype"] not in PROTO_TYPE:
            raise NoTypedApi(f"output '{t['name']}' is {t['datatype']}, which has no protobuf field type")
        name = _field_name(t["name"], taken)
        taken.add(_json_key(name))
        number += 1
        outputs.append(Tensor(t["name"], t["datatype"], dims, (_tensor_field(name, number, t["name"], t["datatype"], dims, "output"),)))
    schema = TypedSchema(model=model, inputs=tuple(inputs), outputs=tuple(outputs), model_version=str(model_version))
    _check_type_names(schema)
    return schema


def _tensor_field(name, number, tensor, datatype, dims, side, *, required=True, range_=None) -> Field:
    if any(d == -1 for d in dims) and len(dims) > 1:
        raise NoTypedApi(f"{side} '{tensor}' has variable dims {list(dims)} in more than one axis")
    count = None if any(d == -1 for d in dims) else math.prod(dims)
    scalar = count == 1
    return Field(
        name=name, number=number, type=PROTO_TYPE[datatype], tensor=tensor, repeated=not scalar,
        count=None if scalar else count, required=required,
        range=tuple(range_) if range_ is not None and datatype != "BYTES" else None,
    )  # fmt: skip


def _check_type_names(schema: TypedSchema) -> None:
    messages = {f"{schema.stem}{k}" for k in ("Request", "Response", "Row", "BatchRequest", "BatchResponse", "Service")}
    seen: set[str] = set()
    values: set[str] = set()
    for name, f in schema.enums():
        if name in messages or name in seen:
            raise InvalidRequest(f"feature '{f.name}' makes enum type '{name}', which clashes with another type of the schema; rename it")
        seen.add(name)
        for label in ("UNSPECIFIED", *(label for label, _ in f.enum)):
            value = f"{enum_prefix(f)}_{label.upper()}"
            if value in values:  # enum values share the package's scope
                raise InvalidRequest(f"enum value '{value}' of feature '{f.name}' clashes with another enum's value; rename a label")
            values.add(value)


def from_model_signature(sig, *, declared: Mapping[str, Any] | None = None) -> TypedSchema:
    """The typed schema of a model Triton serves (``server.dataplane.signature.ModelSignature``).

    ``declared`` is the model's richer JSON signature (the repository's ``inferplane.json``): used
    when its tensors are the served ones, so the features keep their names; otherwise the fields are
    named after the tensors."""
    if is_llm(sig):
        raise NoTypedApi(f"'{sig.name}' is an LLM: it is served by the OpenAI API and inferplane.v1.Generation")
    if sig.decoupled:
        raise NoTypedApi(f"'{sig.name}' is a decoupled (streaming) model")
    served = {
        "inputs": [{"name": s.name, "datatype": s.datatype, "dims": list(s.dims)} for s in sig.inputs.values()],
        "outputs": [{"name": s.name, "datatype": s.datatype, "dims": list(s.dims)} for s in sig.outputs.values()],
    }
    signature = served
    if declared is not None and _same_tensors(declared, served):
        signature = declared
    optional = [s.name for s in sig.inputs.values() if s.optional]
    return from_signature(sig.name, signature, model_version=sig.latest_version, optional_inputs=optional)


def _same_tensors(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    def key(sig, side):
        return sorted((t["name"], t.get("datatype", "FP32").upper(), tuple(t["dims"])) for t in sig.get(side, ()))

    try:
        return all(key(a, side) == key(b, side) for side in ("inputs", "outputs"))
    except (KeyError, TypeError):
        return False


__all__ = [
    "Field", "NoTypedApi", "Tensor", "TypedSchema", "check_declared", "from_model_signature", "from_signature",
    "normalize_features",
]  # fmt: skip
