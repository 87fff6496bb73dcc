"""Typed messages <-> tensors for one schema (``server.control.typed.typed_schema.TypedSchema``).

Requests: a tabular model's fields become one numpy row per message. The hot path reads the
caller's bytes directly: when every field is a float (or double) and the message arrived in the
canonical encoding (each field once, in number order — what every protobuf library writes), the
bytes have a fixed layout, so one check of the tag bytes and one gather give the row — for a
``PredictBatch`` all rows at once, as an (n, fields) array; no per-field Python. Anything else
(another order, a missing or repeated field, a wrong wire type, integer or enum fields, text)
goes through the message class: one ``operator.attrgetter`` over the fields per row into
``np.fromiter`` (``ListFields()`` measured slower, loadtest/bench_typed.py --decode-only),
presence asked only of the zeros, and vectorized enum / range / integer-width checks; its errors
name each field.

Responses: float outputs of fixed size are Triton's output bytes behind precomputed field
headers (joined for one row; one (n, bytes) array filled by column slices for a batch); others
go through the message class.
"""

from __future__ import annotations

import itertools
import math
import operator

import numpy as np
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from server.control.typed.typed_schema import INT_BOUNDS, Field, Tensor, TypedSchema
from server.dataplane import codecs
from server.dataplane import codecs, wire
from server.errors import InvalidRequest, Violation
from server.protogen.inference import grpc_service_pb2 as pb
from google.protobuf.unknown_fields import UnknownFieldSet

MAX_VIOLATIONS = 20
_WIRE_TYPES = {0: "varint (int, bool or enum)", 1: "64-bit (double)", 2: "length-delimited (string, bytes, message or packed)", 5: "32-bit (float)"}
_EXPECTED_WIRE = {"float": 5, "double": 1, "string": 2}
# how each proto scalar is read into numpy before the tensor's dtype
_WIDE = {"float": np.float64, "double": np.float64, "int32": np.int64, "int64": np.int64, "uint32": np.uint64, "uint64": np.uint64, "bool": np.bool_}


# ---- the canonical fixed layout (hot path) ----------------------------------------------------


class _WireRows:
    """The fixed byte layout of a request whose fields are all singular floats (or all doubles)."""

    def __init__(self, fields: tuple[Field, ...], dtype: np.dtype, wire_type: int):
        width = dtype.itemsize
        template, tag_pos, val_pos = bytearray(), [], []
        for f in fields:
            tag = wire.tag(f.number, wire_type)
            tag_pos += range(len(template), len(template) + len(tag))
            template += tag
            val_pos += range(len(template), len(template) + width)
            template += bytes(width)
        self.dtype = dtype
        self.size = len(template)
        self.tag_idx = np.array(tag_pos, dtype=np.intp)
        self.tag_bytes = bytes(template[i] for i in tag_pos)
        self.val_idx = np.array(val_pos, dtype=np.intp)
        head = b"\x0a" + wire.varint(self.size)  # BatchRequest.rows (field 1, length-delimited)
        self.record = len(head) + self.size
        self.rec_tag_idx = np.concatenate([np.arange(len(head), dtype=np.intp), self.tag_idx + len(head)])
        self.rec_tag_val = np.frombuffer(head + self.tag_bytes, dtype=np.uint8)
        self.rec_val_idx = self.val_idx + len(head)

    @classmethod
    def build(cls, schema: TypedSchema) -> "_WireRows | None":
        if len(schema.inputs) != 1 or not schema.inputs[0].tabular:
            return None
        tensor = schema.inputs[0]
        kinds = {f.type for f in tensor.fields}
        if kinds == {"float"} and tensor.datatype == "FP32":
            return cls(tensor.fields, np.dtype("<f4"), 5)
        if kinds == {"double"} and tensor.datatype == "FP64":
            return cls(tensor.fields, np.dtype("<f8"), 1)
        return None

    def row(self, raw: bytes) -> np.ndarray | None:
        """(1, fields) values, or None when the bytes are not in the canonical layout."""
        if len(raw) != self.size:
            return None
        buf = np.frombuffer(raw, dtype=np.uint8)
        if buf[self.tag_idx].tobytes() != self.tag_bytes:
            return None
        return buf[self.val_idx].view(self.dtype).reshape(1, -1)

    def rows(self, raw: bytes) -> np.ndarray | None:
        """(n, fields) values of a BatchRequest, or None."""
        n, rest = divmod(len(raw), self.record)
        if rest or not n:
            return None
        buf = np.frombuffer(raw, dtype=np.uint8).reshape(n, self.record)
        if not (buf[:, self.rec_tag_idx] == self.rec_tag_val).all():
            return None
        return np.take(buf, self.rec_val_idx, axis=1).view(self.dtype)  # take: a C-ordered copy


class _WireAnswers:
    """The fixed byte layout of responses whose fields are floats (or doubles) of fixed counts."""

    def __init__(self, outputs: tuple[Tensor, ...]):
        template = bytearray()
        self.slices: list[tuple[str, str, int, int, bytes]] = []  # tensor, datatype, offset, bytes, field header
        for t in outputs:
            f = t.fields[0]
            width = 4 if f.type == "float" else 8
            nbytes = (f.count or 1) * width
            if f.repeated:
                header = wire.tag(f.number, 2) + wire.varint(nbytes)
            else:
                header = wire.tag(f.number, 5 if width == 4 else 1)
            template += header
            self.slices.append((t.name, "FP32" if width == 4 else "FP64", len(template), nbytes, header))
            template += bytes(nbytes)
        self.size = len(template)
        self.template = np.frombuffer(bytes(template), dtype=np.uint8)
        head = b"\x0a" + wire.varint(self.size)  # BatchResponse.results (field 1)
        self.record_template = np.frombuffer(head + bytes(template), dtype=np.uint8)
        self.head = len(head)

    @classmethod
    def build(cls, schema: TypedSchema) -> "_WireAnswers | None":
        for t in schema.outputs:
            f = t.fields[0]
            if len(t.fields) != 1 or f.type not in ("float", "double") or (f.repeated and f.count is None):
                return None
            if codecs.numpy_dtype(t.datatype) != np.dtype("<f4" if f.type == "float" else "<f8"):
                return None
        return cls(schema.outputs)

    def encode(self, answer: pb.ModelInferResponse, n: int, batch: bool) -> bytes | None:
        """The response bytes straight from Triton's output bytes (already little-endian floats);
        None when the answer is not what the layout expects (the message path says why)."""
        raw = answer.raw_output_contents
        index = {out.name: i for i, out in enumerate(answer.outputs)}
        chosen = []
        for name, datatype, offset, nbytes, header in self.slices:
            i = index.get(name)
            if i is None or i >= len(raw) or answer.outputs[i].datatype != datatype or len(raw[i]) != n * nbytes:
                return None
            chosen.append(raw[i])
        if n == 1 and not batch:  # Predict: the fields' headers and the bytes, joined
            return b"".join(part for (_, _, _, _, header), data in zip(self.slices, chosen) for part in (header, data))
        template, shift = (self.record_template, self.head) if batch else (self.template, 0)
        out = np.empty((n, template.size), dtype=np.uint8)
        out[:] = template
        for (_, _, offset, nbytes, _), data in zip(self.slices, chosen):
            out[:, shift + offset : shift + offset + nbytes] = np.frombuffer(data, dtype=np.uint8).reshape(n, nbytes)
        return out.tobytes()


# ---- the codec ------------------------------------------------------------------------------


class _TabularPlan:
    """How one tabular input's fields become its tensor row."""

    def __init__(self, tensor: Tensor):
        self.tensor = tensor
        self.fields = tensor.fields
        self.numbers = [f.number for f in tensor.fields]
        self.dtype = codecs.numpy_dtype(tensor.datatype)
        self.has_enum = any(f.enum for f in tensor.fields)
        self.wide = np.float64 if self.has_enum else _WIDE[tensor.fields[0].type]
        self.enum_pos = np.array([i for i, f in enumerate(self.fields) if f.enum], dtype=np.intp)
        self.enum_lut = [np.array([math.nan] + [v for _, v in f.enum], dtype=np.float64) for f in self.fields if f.enum]
        ranged = [(i, f.range) for i, f in enumerate(self.fields) if f.range is not None and not f.enum]
        self.range_pos = np.array([i for i, _ in ranged], dtype=np.intp)
        self.range_lo = np.array([r[0] for _, r in ranged], dtype=np.float64)
        self.range_hi = np.array([r[1] for _, r in ranged], dtype=np.float64)
        self.range_all = len(ranged) == len(self.fields)
        self.lo32, self.hi32 = self.range_lo.astype(np.float32), self.range_hi.astype(np.float32)  # for float32 rows
        self.bounds = INT_BOUNDS.get(tensor.datatype)
        names = [f.name for f in tensor.fields]
        get = operator.attrgetter(*names)
        self.getter = get if len(names) > 1 else (lambda m: (get(m),))  # a tuple of the row's values

    def check(self, rows: np.ndarray, where, violations: list[Violation]) -> np.ndarray:
        """Enum labels -> tensor values, then ranges and integer widths; (n, fields) in the tensor's dtype."""
        if self.has_enum:
            rows = rows.astype(np.float64, copy=True)
            for j, pos in enumerate(self.enum_pos):
                codes = rows[:, pos]
                lut = self.enum_lut[j]
                valid = (codes >= 1) & (codes < lut.size)
                for r in np.flatnonzero(~valid)[:MAX_VIOLATIONS]:
                    f = self.fields[pos]
                    labels = ", ".join(f"{f.name.upper()}_{label.upper()}" for label, _ in f.enum)
                    got = "UNSPECIFIED (0)" if codes[r] == 0 else f"{int(codes[r])}"
                    violations.append(Violation(where(r, f), f"{got} is not a declared value of {f.type} ({labels})"))
                rows[:, pos] = lut[np.where(valid, codes, 0).astype(np.intp)]
        if self.range_pos.size:
            values = rows if self.range_all else rows[:, self.range_pos]
            lo, hi = (self.lo32, self.hi32) if values.dtype == np.float32 else (self.range_lo, self.range_hi)
            ok = (values >= lo) & (values <= hi)  # NaN is never in range
            if np.count_nonzero(ok) != ok.size:
                for r, c in zip(*np.nonzero(~ok)):
                    if len(violations) >= MAX_VIOLATIONS:
                        break
                    f = self.fields[self.range_pos[c]]
                    unit = f" {f.unit}" if f.unit else ""
                    violations.append(Violation(where(r, f), f"{float(values[r, c]):g}{unit} is outside the declared range [{f.range[0]:g}, {f.range[1]:g}]"))
        if self.bounds is not None:
            lo, hi = self.bounds
            bad = (rows < lo) | (rows > hi)
            for r, c in zip(*np.nonzero(bad)):
                if len(violations) >= MAX_VIOLATIONS:
                    break
                violations.append(Violation(where(r, self.fields[c]), f"{int(rows[r, c])} does not fit {self.tensor.datatype} [{lo}, {hi}]"))
        return rows.astype(self.dtype, copy=False)


class Codec:
    """Request bytes -> a ModelInferRequest for the model; its answer -> response bytes."""

    def __init__(self, schema: TypedSchema, pool):
        self.schema = schema

        def cls(kind):
            return message_factory.GetMessageClass(pool.FindMessageTypeByName(schema.message(kind)))

        self.Request, self.Row, self.BatchRequest = cls("Request"), cls("Row"), cls("BatchRequest")
        self.Response, self.BatchResponse = cls("Response"), cls("BatchResponse")
        self.plans = [_TabularPlan(t) if t.tabular else None for t in schema.inputs]
        self.wire = _WireRows.build(schema)
        self.answers = _WireAnswers.build(schema)
        self.numbers = {f.number: f for f in schema.request_fields}

    # -- requests --

    def decode(self, raw: bytes, batch: bool) -> tuple[list[np.ndarray | None], int]:
        """Per input, its (rows, *dims) array (None: an optional input nobody sent), and the row count."""
        if self.wire is not None:
            rows = self.wire.rows(raw) if batch else self.wire.row(raw)
            if rows is not None:
                violations: list[Violation] = []
                rows = self.plans[0].check(rows, _where(batch), violations)
                if violations:
                    raise _invalid(self.schema, violations)
                return [rows], len(rows)
        try:
            message = (self.BatchRequest if batch else self.Request).FromString(raw)
        except DecodeError as err:
            raise InvalidRequest(f"the request is not a valid {self.schema.message('BatchRequest' if batch else 'Request')}: {err}") from None
        messages = list(message.rows) if batch else [message]
        if not messages:
            raise InvalidRequest("PredictBatch needs at least one row", [Violation("rows", "no rows")])
        return self.read(messages, batch), len(messages)

    def read(self, messages, batch: bool = False) -> list[np.ndarray | None]:
        """The general path: every message's fields, checked, into tensors."""
        violations: list[Violation] = []
        where = _where(batch)
        out: list[np.ndarray | None] = []
        for t, plan in zip(self.schema.inputs, self.plans):
            if plan is not None:
                out.append(self._tabular(t, plan, messages, where, violations))
            else:
                out.append(self._whole(t, messages, where, violations))
        if violations:
            raise _invalid(self.schema, violations)
        return out

    def _tabular(self, t: Tensor, plan: _TabularPlan, messages, where, violations) -> np.ndarray | None:
        """One C-level attrgetter per row reads the values (an unset field reads 0); only the
        zeros are then asked whether they were sent (proto3 ``optional`` presence)."""
        n, k = len(messages), len(plan.fields)
        get = plan.getter
        rows = np.fromiter(itertools.chain.from_iterable(map(get, messages)), dtype=plan.wide, count=n * k).reshape(n, k)
        missing = np.zeros((n, k), dtype=bool)
        for r, c in zip(*np.nonzero(rows == 0)):
            missing[r, c] = not messages[r].HasField(plan.fields[c].name)
        if not missing.any():
            return plan.check(rows, where, violations)
        unsent = missing.all(axis=1)
        if t.optional and unsent.all():
            return None
        for r in np.flatnonzero(missing.any(axis=1)):
            if t.optional and unsent[r]:
                violations.append(Violation(f"rows[{r}]" if len(messages) > 1 else t.name,
                                            f"input '{t.name}' is optional but must be sent in every row or in none"))  # fmt: skip
                continue
            self._missing(messages[r], [plan.fields[c] for c in np.flatnonzero(missing[r])], r, where, violations)
        complete = np.flatnonzero(~missing.any(axis=1))
        plan.check(rows[complete], lambda r, f: where(int(complete[r]), f), violations)  # every problem named
        return None

    def _whole(self, t: Tensor, messages, where, violations) -> np.ndarray | None:
        """A field that is the whole tensor: a scalar, a string or a repeated (packed) field."""
        f = t.fields[0]
        values: list = []
        for r, message in enumerate(messages):
            value = getattr(message, f.name)
            if (not value) if f.repeated else not message.HasField(f.name):  # an empty repeated field was not sent
                value = None
                if f.required:
                    self._missing(message, (f,), r, where, violations)
            elif f.repeated and f.count is not None and len(value) != f.count:
                violations.append(Violation(where(r, f), f"expected {f.count} values (tensor '{t.name}' {list(t.dims)}), got {len(value)}"))
            values.append(value if value is None or f.repeated else (value,))
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            if not f.required:
                violations.append(Violation("rows", f"input '{t.name}' is optional but must be sent in every row or in none"))
            return None
        n = len(values)
        per_row = len(values[0])
        if any(len(v) != per_row for v in values):
            violations.append(Violation(where(0, f), "every row must carry the same number of values"))
            return None
        if violations:
            return None
        if t.datatype == "BYTES":
            array = np.empty(n * per_row, dtype=np.object_)
            array[:] = [s.encode() for v in values for s in v]
        else:
            array = np.fromiter((x for v in values for x in v), dtype=_WIDE[f.type], count=n * per_row)
            array = self._checked(t, f, array.reshape(n, per_row), where, violations)
        dims = [per_row] if f.repeated and f.count is None else list(t.dims)
        return array.reshape([n, *dims])

    @staticmethod
    def _checked(t: Tensor, f: Field, rows: np.ndarray, where, violations) -> np.ndarray:
        if f.range is not None:
            ok = (rows >= f.range[0]) & (rows <= f.range[1])
            for r in np.flatnonzero(~ok.all(axis=1))[:MAX_VIOLATIONS]:
                violations.append(Violation(where(r, f), f"values outside the declared range [{f.range[0]:g}, {f.range[1]:g}]"))
        bounds = INT_BOUNDS.get(t.datatype)
        if bounds is not None:
            bad = ((rows < bounds[0]) | (rows > bounds[1])).any(axis=1)
            for r in np.flatnonzero(bad)[:MAX_VIOLATIONS]:
                violations.append(Violation(where(r, f), f"values that do not fit {t.datatype} [{bounds[0]}, {bounds[1]}]"))
        return rows.astype(codecs.numpy_dtype(t.datatype), copy=False)

    def _missing(self, message, fields, r: int, where, violations) -> None:
        """Name each field a row lacks; a field that came with the wrong wire type says so."""
        wrong = _unknown_numbers(message)
        for f in fields:
            if f.number in wrong:
                got = _WIRE_TYPES.get(wrong[f.number], f"wire type {wrong[f.number]}")
                violations.append(Violation(where(r, f), f"wrong type: got a {got} value, expected {'repeated ' if f.repeated else ''}{f.type}"))
            else:
                violations.append(Violation(where(r, f), f"required field is missing ({'repeated ' if f.repeated else ''}{f.type} = {f.number})"))

    def infer_request(self, arrays: list[np.ndarray | None], batched: bool) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name=self.schema.model)
        for t, array in zip(self.schema.inputs, arrays):
            if array is None:
                continue
            if not batched:  # the model takes no batch dimension: one row, its own shape
                array = array.reshape(array.shape[1:])
            if t.datatype == "BYTES":
                data = codecs.serialize_bytes(array.reshape(-1))
            else:
                data = np.ascontiguousarray(array).tobytes()
            request.inputs.add(name=t.name, datatype=t.datatype, shape=array.shape)
            request.raw_input_contents.append(data)
        return request

    # -- responses --

    def encode(self, answer: pb.ModelInferResponse, n: int, batch: bool, batched: bool) -> bytes:
        if self.answers is not None:
            data = self.answers.encode(answer, n, batch)
            if data is not None:
                return data
        outputs: dict[str, np.ndarray] = {}
        raw = answer.raw_output_contents
        for i, out in enumerate(answer.outputs):
            if i >= len(raw):
                raise InvalidRequest(f"the model's answer carries no data for output '{out.name}'")
            shape = list(out.shape) if batched else [1, *out.shape]
            outputs[out.name] = codecs.to_numpy(raw[i], out.datatype, shape)
        missing = [t.name for t in self.schema.outputs if t.name not in outputs]
        if missing:
            raise ValueError(f"the model's answer lacks outputs {missing}")
        if not batch:
            return self._fill(self.Response(), outputs, 0).SerializeToString()
        message = self.BatchResponse()
        for r in range(n):
            self._fill(message.results.add(), outputs, r)
        return message.SerializeToString()

    def _fill(self, message, outputs: dict[str, np.ndarray], r: int):
        for t in self.schema.outputs:
            f = t.fields[0]
            row = outputs[t.name][r].reshape(-1)
            if t.datatype == "BYTES":
                items = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in row]
            else:
                items = row.tolist()
            if f.repeated:
                getattr(message, f.name).extend(items)
            elif items:
                setattr(message, f.name, items[0])
        return message


def _where(batch: bool):
    if batch:
        return lambda r, f: f"rows[{r}].{f.name}"
    return lambda r, f: f.name


def _unknown_numbers(message) -> dict[int, int]:
    """field number -> wire type of the unknown fields a message carried (a field of ours sent with
    another wire type lands there)."""
    try:
        return {u.field_number: u.wire_type for u in UnknownFieldSet(message)}
    except Exception:  # an implementation without unknown-field access: say "missing" instead
        return {}


def _invalid(schema: TypedSchema, violations: list[Violation]) -> InvalidRequest:
    listed = "; ".join(f"{v.field}: {v.description}" for v in violations[:3])
    more = f" (+{len(violations) - 3} more)" if len(violations) > 3 else ""
    return InvalidRequest(f"model '{schema.model}' ({schema.stem}Service): {listed}{more}", violations[:MAX_VIOLATIONS])
