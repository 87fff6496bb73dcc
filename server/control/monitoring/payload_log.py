"""Payload logging: sampled requests and answers of the endpoints that opt in, redacted, as JSON lines.

Off by default. An endpoint opts in with parameters in its config:

- ``inferplane.payload_log_sample``: share of its requests logged (``0.05``)
- ``inferplane.payload_log_redact_tensors``: tensor names whose values are replaced (``ssn,card``)
- ``inferplane.payload_log_redact_paths``: JSON paths in the record replaced
  (``$.headers.x-user-id, $.request.inputs[*].data``; ``[*]`` every element, ``[N]`` one)
- ``inferplane.payload_log_redact_regex``: a regex, or a JSON list of them, replaced in every string

Whatever an endpoint says, API keys never reach a record: the ``authorization``, ``x-api-key``,
``proxy-authorization`` and ``cookie`` headers are dropped, and any string that looks like a key
(``ipk_…``) or a bearer token is replaced. Records carry the tenant, team and key *id* (not secret).

The pipeline queues sampled requests undecoded (``server.dataplane.observe``); this writer drains the
queue every ``flush_s``, decodes and redacts in a thread, and writes to ``INFERPLANE_PAYLOAD_LOG_DESTINATION``:
a local folder (JSONL files appended, a new one every ``file_records``) or any fsspec URL (one file
per flush: object stores cannot append). Retention: the oldest files are deleted while the folder
holds more than ``max_records`` records or ``max_bytes`` bytes, and records older than the retention
setting (``retention_days["payload_logs"]``) are deleted by ``server.control.registry.retention``.

Encryption at rest (``server.control.registry.envelope``): with an encryption key each line is
``{"ts", "tenant", "enc"}``, the record sealed with AES-GCM under a fresh data key (``ts`` and ``tenant``
stay readable so retention and ``inferplane data purge --tenant`` need no key). Read them with
``inferplane data show payloads``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import re
from dataclasses import dataclass, field

import numpy as np
import fsspec

from server.control.registry.envelope import seal_line
from server.dataplane import codecs
from server.protogen.inference import grpc_service_pb2 as pb
from server.control.registry.records import RecordFiles

log = logging.getLogger(__name__)

REDACTED = "[REDACTED]"
SENSITIVE_HEADERS = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie", "set-cookie"})
# an API key (server.tenancy.identity: ipk_<8 hex>_<secret>) or a bearer token, wherever it appears
SECRETS = re.compile(r"ipk_[0-9a-fA-F]{8}_[A-Za-z0-9_\-]+|(?i:bearer)\s+\S+")
MAX_ELEMENTS = 4096  # per tensor; longer ones are cut (``truncated: true``)
PREFIX = "payloads-"


@dataclass(frozen=True)
class Redaction:
    tensors: frozenset[str] = frozenset()
    paths: tuple[tuple, ...] = ()  # parsed JSON paths
    patterns: tuple[re.Pattern, ...] = ()

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "Redaction":
        tensors = frozenset(t.strip() for t in params.get("inferplane.payload_log_redact_tensors", "").split(",") if t.strip())
        paths = tuple(parse_path(p.strip()) for p in params.get("inferplane.payload_log_redact_paths", "").split(",") if p.strip())
        raw = params.get("inferplane.payload_log_redact_regex", "").strip()
        patterns: list[str] = []
        if raw:
            try:
                loaded = json.loads(raw)
                patterns = [loaded] if isinstance(loaded, str) else [str(p) for p in loaded]
            except ValueError:
                patterns = [raw]
        return cls(tensors, paths, tuple(re.compile(p) for p in patterns))


def parse_path(path: str) -> tuple:
    """``$.a.b[*].c[0]`` -> ('a', 'b', '*', 'c', 0)."""
    if not path.startswith("$"):
        raise ValueError(f"a JSON path starts with $: {path!r}")
    steps: list = []
    for token in re.findall(r"\.([^.\[\]]+)|\[(\*|\d+)\]", path[1:]):
        name, index = token
        if name:
            steps.append(name)
        else:
            steps.append("*" if index == "*" else int(index))
    return tuple(steps)


def _apply_path(node, steps: tuple) -> None:
    if not steps:
        return
    step, rest = steps[0], steps[1:]
    if isinstance(node, dict):
        keys = list(node) if step == "*" else [step] if step in node else []
        for key in keys:
            if rest:
                _apply_path(node[key], rest)
            else:
                node[key] = REDACTED
    elif isinstance(node, list):
        indices = range(len(node)) if step == "*" else [step] if isinstance(step, int) and step < len(node) else []
        for i in indices:
            if rest:
                _apply_path(node[i], rest)
            else:
                node[i] = REDACTED


def _scrub(node, patterns: tuple):
    """Replace secrets (always) and the endpoint's patterns in every string of the record."""
    if isinstance(node, str):
        node = SECRETS.sub(REDACTED, node)
        for pattern in patterns:
            node = pattern.sub(REDACTED, node)
        return node
    if isinstance(node, dict):
        return {k: _scrub(v, patterns) for k, v in node.items()}
    if isinstance(node, list):
        return [_scrub(v, patterns) for v in node]
    return node


def _headers(headers) -> dict[str, str]:
    if headers is None:
        return {}
    items = headers.items() if hasattr(headers, "items") else headers
    out = {}
    for key, value in items:
        key = str(key).lower()
        if key in SENSITIVE_HEADERS or key.endswith("-bin") or not isinstance(value, str):
            continue
        out[key] = value
    return out


def _tensor(name: str, datatype: str, shape, raw: bytes | None, redact: bool) -> dict:
    doc: dict = {"name": name, "datatype": datatype, "shape": [int(d) for d in shape]}
    if redact:
        doc["data"] = REDACTED
        return doc
    if raw is None:
        return doc
    try:
        array = codecs.to_numpy(raw, datatype, [int(d) for d in shape]).reshape(-1)
    except Exception:  # noqa: BLE001 - a tensor the codec cannot read is logged without data
        doc["data"] = None
        return doc
    if array.size > MAX_ELEMENTS:
        doc["truncated"] = True
        array = array[:MAX_ELEMENTS]
    if array.dtype == object:
        doc["data"] = [bytes(v).decode("utf-8", "replace") for v in array]
    else:
        doc["data"] = array.astype(np.float64 if array.dtype.kind == "f" else array.dtype).tolist()
    return doc


def build_record(sample, redaction: Redaction) -> dict:
    """One JSON record of a sampled request (decoded, redacted)."""
    request = sample.request
    inputs = []
    for i, t in enumerate(request.inputs):
        raw = request.raw_input_contents[i] if i < len(request.raw_input_contents) else None
        inputs.append(_tensor(t.name, t.datatype, t.shape, raw, t.name in redaction.tensors))
    record: dict = {
        "ts": dt.datetime.fromtimestamp(sample.at, dt.timezone.utc).isoformat(timespec="milliseconds"),
        "model": sample.model, "version": sample.version, "kind": sample.kind, "code": sample.code,
        "latency_ms": round(sample.latency_s * 1000, 3),
        "tenant": sample.tenant, "team": sample.team, "key_id": sample.key_id,
        "headers": _headers(sample.headers),
        "request": {"id": request.id, "inputs": inputs},
        "response": None,
    }  # fmt: skip
    if sample.answer is not None:
        response = pb.ModelInferResponse.FromString(sample.answer)
        outputs = []
        for i, t in enumerate(response.outputs):
            raw = response.raw_output_contents[i] if i < len(response.raw_output_contents) else None
            outputs.append(_tensor(t.name, t.datatype, t.shape, raw, t.name in redaction.tensors))
        record["response"] = {"outputs": outputs}
    for steps in redaction.paths:
        _apply_path(record, steps)
    return _scrub(record, redaction.patterns)


@dataclass
class _File:
    path: str
    records: int = 0
    bytes: int = 0


@dataclass
class PayloadLog:
    """The writer (one per serving process); ``redaction(name)`` gives an endpoint's rules."""

    observer: object  # server.dataplane.observe.Observer
    metrics: object
    destination: str
    redaction: object  # Callable[[str], Redaction]
    max_records: int = 100_000
    max_bytes: int = 256 << 20
    file_records: int = 10_000
    flush_s: float = 1.0
    keys: object = None  # server.control.registry.envelope.KeyRing: records sealed at rest
    written: int = 0
    _files: list[_File] = field(default_factory=list)
    _current: _File | None = None

    def __post_init__(self):
        self.fs, self.root = fsspec.core.url_to_fs(self.destination)
        self.records = RecordFiles(self.destination, PREFIX, self.keys)  # the lock a purge shares
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self._opened = False  # the destination is touched only once a record is written

    def _open(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        self._files = self._existing()
        self._opened = True

    def _existing(self) -> list[_File]:
        files = []
        for path in sorted(self.fs.glob(f"{self.root.rstrip('/')}/{PREFIX}*.jsonl")):
            info = self.fs.info(path)
            with self.fs.open(path, "rb") as f:
                records = sum(1 for _ in f)
            files.append(_File(path, records, int(info.get("size", 0))))
        return files

    def _new_file(self) -> _File:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        return _File(f"{self.root.rstrip('/')}/{PREFIX}{stamp}-{os.getpid()}.jsonl")

    def write(self, samples: list) -> int:
        """Decode, redact and write these samples (in a thread); returns records written."""
        lines = []
        for sample in samples:
            try:
                lines.append(seal_line(self.keys, build_record(sample, self.redaction(sample.model))))
            except Exception as err:  # noqa: BLE001 - one unreadable request must not stop the log
                log.warning("payload log: cannot encode a request to %s: %s", sample.model, err)
                self.metrics.payload_dropped.labels(sample.model).inc()
        if not lines:
            return 0
        if not self._opened:
            self._open()
        data = ("\n".join(lines) + "\n").encode()
        with self.records.locked():  # a purge (inferplane data purge) rewrites files under this lock
            target = self._append(data)
        target.records += len(lines)
        target.bytes += len(data)
        for sample in samples:
            self.metrics.payload_logged.labels(sample.model).inc()
        self.written += len(lines)
        self._retain()
        return len(lines)

    def _append(self, data: bytes) -> "_File":
        if self.local:
            if self._current is None or self._current.records >= self.file_records:
                self._current = self._new_file()
                self._files.append(self._current)
            with self.fs.open(self._current.path, "ab") as f:
                f.write(data)
            target = self._current
        else:
            target = self._new_file()
            with self.fs.open(target.path, "wb") as f:
                f.write(data)
            self._files.append(target)
        return target

    def _retain(self) -> None:
        """Delete the oldest files while over the record or byte limit (the newest file always stays)."""
        while len(self._files) > 1 and (
            sum(f.records for f in self._files) > self.max_records or sum(f.bytes for f in self._files) > self.max_bytes
        ):
            oldest = self._files.pop(0)
            if oldest is self._current:
                self._current = None
            try:
                self.fs.rm(oldest.path)
            except FileNotFoundError:
                pass

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> int:
        samples = self.observer.payloads.drain()
        if not samples:
            return 0
        try:
            return await asyncio.to_thread(self.write, samples)
        except Exception as err:  # the destination is away: these records are lost, counted
            log.warning("payload log write of %d records failed: %s", len(samples), err)
            for sample in samples:
                self.metrics.payload_dropped.labels(sample.model).inc()
            return 0


def redaction_for(dataplane):
    """An endpoint's redaction rules from its signature's parameters (cached per signature)."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> Redaction:
        signature = dataplane.signature(name)
        entry = cache.get(name)
        if entry is None or entry[0] is not signature:
            entry = cache[name] = (signature, Redaction.from_params(signature.params if signature is not None else {}))
        return entry[1]

    return get

