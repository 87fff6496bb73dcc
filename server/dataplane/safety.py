"""Safety filters: one optional stage of the pipeline, per endpoint, for input and for output.

An endpoint's policy is JSON — its config parameter ``inferplane.safety``, else the settings'
``safety[NAME]``, else ``safety["*"]``; no policy, no stage (nothing on the hot path)::

    {"input":  {"rules": [{"name": "pii", "kind": "pii", "types": ["email", "card"], "action": "redact"},
                          {"name": "deny", "kind": "keywords", "words": ["project zeus"], "action": "block"}],
                "classifier": {"model": "safety_classifier", "label": "unsafe", "threshold": 0.8, "action": "block"}},
     "output": {"rules": [{"name": "pii", "kind": "pii", "action": "redact"}], "window": 64,
                "classifier": {"model": "safety_classifier", "threshold": 0.8, "every_chars": 256}}}

- **Input** is screened at validate (``Pipeline.enter``): the texts of the request — chat messages or
  a prompt, embedding inputs, a model's declared text inputs (``inferplane.text_inputs``) — are checked
  by the rules (:mod:`server.dataplane.safety_rules`), then by the classifier. ``block`` refuses the
  request (``ContentFiltered``: INVALID_ARGUMENT / 400, reason ``CONTENT_FILTER``), ``redact`` rewrites
  the text the model sees, ``flag`` passes it and records the decision.
- **Output** is screened in generation streams and unary answers: a stream through a
  :class:`OutputStream`, which holds back a window of characters across chunk boundaries (a match split
  over two chunks is caught before any of it leaves) and runs the classifier every ``every_chars`` new
  characters; a blocked stream ends with ``finish_reason: "content_filter"`` (the OpenAI API's). A unary
  answer's text outputs (BYTES) are checked whole; a blocked one is refused with ``ContentFiltered``.
- The **classifier** is a model deployed on the platform (the demo ships ``safety_classifier``: MiniLM
  embeddings and a logistic head trained on synthetic data, ONNX), called through the model port
  that admitted the request (``server.dataplane.port``) on the caller's behalf: it is batched, queued, scaled and metered like any other request (charged to
  the caller's tenant), and never screened itself.

Every decision is counted (``inferplane_safety_decisions_total{model,stage,rule,action}``, ``allow``
included) and timed (``inferplane_safety_seconds{stage}``); every non-``allow`` decision is an audit
record (actor, action ``safety.block|redact|flag``, endpoint, stage, rule names and counts — never
the text). Endpoints with an output policy refuse raw ``ModelStreamInfer`` (its answers are Triton's
bytes, passed through unscreened): their callers use ``Generate`` or the OpenAI routes.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter, Histogram

from server.dataplane import codecs
from server.dataplane.port import ModelPort
from server.dataplane.safety_rules import ALLOW, BLOCK, FLAG, REDACT, Finding, PolicyError, Screen, StreamScanner, Verdict, compile_screen
from server.errors import ContentFiltered, InferplaneError
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import ALL_MODELS, CallContext, Delegation

log = logging.getLogger(__name__)

POLICY_PARAMETER = "inferplane.safety"
CONTENT_FILTER = "content_filter"  # the finish_reason of a blocked stream (OpenAI's)
INPUT, OUTPUT = "input", "output"
CLASSIFIER_INPUT, CLASSIFIER_OUTPUT, LABELS_PARAMETER = "text", "probabilities", "inferplane.labels"


# ---- policies ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Classifier:
    model: str
    label: str = "unsafe"
    threshold: float = 0.5
    action: str = BLOCK  # block | flag
    every_chars: int = 256  # streams: classify the recent text each time this many new characters arrived
    context_chars: int = 512  # how much recent text a stream's check reads

    @classmethod
    def from_doc(cls, doc, where: str) -> "Classifier | None":
        if doc is None:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), str) or not doc["model"]:
            raise PolicyError(f"{where}.classifier.model: the name of a deployed classifier model")
        action = doc.get("action", BLOCK)
        if action not in (BLOCK, FLAG):
            raise PolicyError(f"{where}.classifier.action: block or flag, got {action!r}")
        threshold = float(doc.get("threshold", 0.5))
        if not 0 < threshold < 1:
            raise PolicyError(f"{where}.classifier.threshold: in (0, 1), got {threshold}")
        return cls(
            doc["model"], str(doc.get("label", "unsafe")), threshold, action,
            max(16, int(doc.get("every_chars", 256))), max(16, int(doc.get("context_chars", 512))),
        )  # fmt: skip


@dataclass(frozen=True)
class Direction:
    screen: Screen
    classifier: Classifier | None = None

    @property
    def empty(self) -> bool:
        return not self.screen.rules and self.classifier is None


@dataclass(frozen=True)
class SafetyPolicy:
    input: Direction | None = None
    output: Direction | None = None
    error: str = ""  # the endpoint's policy does not compile: every request is refused (never served unfiltered)

    @classmethod
    def from_doc(cls, doc: dict) -> "SafetyPolicy":
        if not isinstance(doc, dict):
            raise PolicyError("a safety policy is a JSON object with 'input' and/or 'output'")
        unknown = set(doc) - {INPUT, OUTPUT}
        if unknown:
            raise PolicyError(f"unknown keys {sorted(unknown)} (expected input, output)")

        def direction(where: str) -> Direction | None:
            part = doc.get(where)
            if part is None:
                return None
            screen = compile_screen(part, where)
            d = Direction(screen, Classifier.from_doc(part.get("classifier"), where))
            return None if d.empty else d

        return cls(direction(INPUT), direction(OUTPUT))


def policy_source(settings_policies: dict[str, dict]):
    """``(name, signature) -> SafetyPolicy | None``: the endpoint's parameter, else the settings' entry
    for it, else the settings' ``*``; compiled once per signature (a config change recompiles)."""
    cache: dict[str, tuple[object, SafetyPolicy | None]] = {}
    compiled_settings: dict[str, SafetyPolicy] = {}
    for name, doc in (settings_policies or {}).items():
        try:
            compiled_settings[name] = SafetyPolicy.from_doc(doc)
        except PolicyError as err:
            raise PolicyError(f"safety[{name!r}]: {err}") from None

    def get(name: str, signature) -> SafetyPolicy | None:
        entry = cache.get(name)
        if entry is not None and entry[0] is signature:
            return entry[1]
        raw = (signature.params or {}).get(POLICY_PARAMETER, "").strip() if signature is not None else ""
        policy = None
        if raw:
            try:
                policy = SafetyPolicy.from_doc(json.loads(raw))
            except (ValueError, PolicyError) as err:  # a broken policy must not open the endpoint unfiltered
                log.error("endpoint %s: its %s parameter does not compile (%s): every request is refused", name, POLICY_PARAMETER, err)
                policy = SafetyPolicy(error=f"endpoint '{name}' has a safety policy that does not compile ({err}); ask its owner to fix it")
        else:
            policy = compiled_settings.get(name) or compiled_settings.get("*")
        cache[name] = (signature, policy)
        return policy

    return get


# ---- the texts of a request ---------------------------------------------------------------------------


class TextSlots:
    """The texts of one request a screen reads and may rewrite (redaction): ``get()`` and ``put(texts)``."""

    __slots__ = ("get", "put")

    def __init__(self, get: Callable[[], list[str]], put: Callable[[list[str]], None]):
        self.get, self.put = get, put


def _decode_elements(raw: bytes) -> list[str]:
    return [bytes(v).decode("utf-8", "replace") for v in codecs.to_numpy(raw, "BYTES", [-1]).reshape(-1)]


def tensor_texts(tensors, raws, names) -> TextSlots:
    """The UTF-8 elements of the named BYTES tensors (request inputs or answer outputs, raw contents)."""
    picked = [(i, t) for i, t in enumerate(tensors) if t.name in names and t.datatype == "BYTES" and i < len(raws)]
    counts: list[int] = []

    def get() -> list[str]:
        out: list[str] = []
        counts.clear()
        for i, _ in picked:
            elements = _decode_elements(raws[i])
            counts.append(len(elements))
            out.extend(elements)
        return out

    def put(texts: list[str]) -> None:
        pos = 0
        for (i, _), n in zip(picked, counts):
            raws[i] = codecs.serialize_bytes([t.encode("utf-8") for t in texts[pos : pos + n]])
            pos += n

    return TextSlots(get, put)


def infer_texts(request: pb.ModelInferRequest, names) -> TextSlots:
    """A ModelInferRequest's declared text inputs; ``put`` rewrites its raw contents."""
    return tensor_texts(request.inputs, request.raw_input_contents, names)


# ---- the stage -----------------------------------------------------------------------------------


class _Metrics:
    def __init__(self, registry):
        self.decisions = Counter(
            "inferplane_safety_decisions",
            "Safety filter decisions, by model, stage (input | output), rule (or 'none') and action (allow | flag | redact | block).",
            ("model", "stage", "rule", "action"),
            registry=registry,
        )
        self.seconds = Histogram(
            "inferplane_safety_seconds",
            "Time the safety filters added to a request, by stage (rules and classifier calls).",
            ("stage",),
            buckets=(0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0),
            registry=registry,
        )


class SafetyStage:
    """Built once (``server.dataplane.builder``); the pipeline calls it for calls whose endpoint has a policy."""

    def __init__(self, policy_for, metrics, *, audit: Callable[[dict], None] | None = None):
        self._policy_for = policy_for
        self._metrics = _Metrics(metrics.registry)
        self._audit = audit

    def policy(self, call) -> SafetyPolicy | None:
        ctx = call.ctx
        if ctx is not None and ctx.delegation is not None and ctx.delegation.platform:
            return None  # the platform's own call (a classifier): never screened itself
        policy = self._policy_for(call.name, call.signature)
        if policy is not None and policy.error:
            raise InferplaneError(policy.error)
        return policy

    # ---- input ---------------------------------------------------------------------------

    async def screen_input(self, call, slots: TextSlots) -> None:
        direction = call.safety.input if call.safety is not None else None
        if direction is None:
            return
        started = time.perf_counter()
        try:
            texts = slots.get()
            verdicts = [direction.screen.check(t) for t in texts]
            findings = [f for v in verdicts for f in v.findings]
            if any(f.action == BLOCK for f in findings):
                self._decide(call, INPUT, findings)
                raise ContentFiltered(_blocked_message(INPUT, findings))
            if any(f.action == REDACT for f in findings):
                slots.put([v.text for v in verdicts])
            if direction.classifier is not None and texts:
                findings += await self._classify(call, direction.classifier, [v.text for v in verdicts])
                if any(f.action == BLOCK for f in findings):
                    self._decide(call, INPUT, findings)
                    raise ContentFiltered(_blocked_message(INPUT, findings))
            self._decide(call, INPUT, findings)
        finally:
            self._metrics.seconds.labels(INPUT).observe(time.perf_counter() - started)

    # ---- output --------------------------------------------------------------------------

    async def screen_output(self, call, slots: TextSlots) -> bool:
        """A unary answer's texts; True when they were rewritten (redacted). Blocked: ContentFiltered."""
        direction = call.safety.output if call.safety is not None else None
        if direction is None:
            return False
        started = time.perf_counter()
        try:
            texts = slots.get()
            verdicts = [direction.screen.check(t) for t in texts]
            findings = [f for v in verdicts for f in v.findings]
            if direction.classifier is not None and texts and not any(f.action == BLOCK for f in findings):
                findings += await self._classify(call, direction.classifier, [v.text for v in verdicts])
            self._decide(call, OUTPUT, findings)
            if any(f.action == BLOCK for f in findings):
                raise ContentFiltered(_blocked_message(OUTPUT, findings))
            if any(f.action == REDACT for f in findings):
                slots.put([v.text for v in verdicts])
                return True
            return False
        finally:
            self._metrics.seconds.labels(OUTPUT).observe(time.perf_counter() - started)

    def stream(self, call) -> "OutputStream | None":
        direction = call.safety.output if call.safety is not None else None
        return OutputStream(self, call, direction) if direction is not None else None

    # ---- pieces --------------------------------------------------------------------------

    async def _classify(self, call, classifier: Classifier, texts: list[str]) -> list[Finding]:
        """One ModelInfer of the classifier model on the caller's behalf; a finding per text over the threshold."""
        scores = await self.classify(call, classifier, texts)
        return [Finding(f"classifier:{classifier.model}", "classifier", classifier.action, 0, 0) for s in scores if s >= classifier.threshold]

    async def classify(self, call, classifier: Classifier, texts: list[str]) -> list[float]:
        port: ModelPort = call.port  # the port that admitted the call: the classifier goes through it too
        ctx = CallContext(timeout=call.timeout, delegation=Delegation(call.principal, ALL_MODELS))
        signature = port.resolve_for(ctx, classifier.model)
        labels = [x.strip() for x in signature.params.get(LABELS_PARAMETER, "safe,unsafe").split(",")]
        if classifier.label not in labels:
            raise InferplaneError(f"safety classifier '{classifier.model}' has no label '{classifier.label}' (labels: {', '.join(labels)})")
        index = labels.index(classifier.label)
        limit = signature.max_batch_size or 1
        scores: list[float] = []
        for start in range(0, len(texts), limit):
            batch = texts[start : start + limit]
            request = pb.ModelInferRequest(model_name=classifier.model)
            request.inputs.add(name=CLASSIFIER_INPUT, datatype="BYTES", shape=[len(batch), 1])
            request.raw_input_contents.append(codecs.serialize_bytes([t.encode("utf-8") for t in batch]))
            raw = (await port.infer(request, ctx=ctx)).raw
            answer = pb.ModelInferResponse.FromString(raw)
            names = [o.name for o in answer.outputs]
            if CLASSIFIER_OUTPUT not in names:
                raise InferplaneError(f"safety classifier '{classifier.model}' answered no '{CLASSIFIER_OUTPUT}' output")
            i = names.index(CLASSIFIER_OUTPUT)
            probs = np.frombuffer(answer.raw_output_contents[i], dtype="<f4").reshape(len(batch), -1)
            scores.extend(float(p) for p in probs[:, index])
        return scores

    def _decide(self, call, stage: str, findings: list[Finding]) -> None:
        """Count the decision (allow too) and audit anything else."""
        counts = self._metrics.decisions
        if not findings:
            counts.labels(call.label, stage, "none", ALLOW).inc()
            return
        by_rule = Tally((f.rule, f.action) for f in findings)
        for (rule, action), n in by_rule.items():
            counts.labels(call.label, stage, rule, action).inc(n)
        action = max((f.action for f in findings), key=(ALLOW, FLAG, REDACT, BLOCK).index)
        if self._audit is not None:
            principal = call.principal
            detail = ", ".join(f"{rule}:{act} x{n}" if n > 1 else f"{rule}:{act}" for (rule, act), n in sorted(by_rule.items()))
            kinds = sorted({f.kind for f in findings})
            try:
                self._audit({
                    "at": time.time(), "actor": f"{principal.name}/{principal.key_id or '-'}" if principal else "-",
                    "action": f"safety.{action}", "target": f"{call.name}:{call.version}" if call.version else call.name,
                    "outcome": stage, "detail": f"{detail} (detectors: {', '.join(kinds)})",
                })  # fmt: skip
            except Exception:  # the audit buffer must never change an answer
                log.exception("recording a safety decision failed")


def _blocked_message(stage: str, findings: list[Finding]) -> str:
    rules = sorted({f.rule for f in findings if f.action == BLOCK})
    what = "the request" if stage == INPUT else "the answer"
    return f"{what} was blocked by the content filter (rules: {', '.join(rules)})"


class OutputStream:
    """The output screen of one generation: ``await chunk(c)`` rewrites a chunk's text (what may be
    released now) and, when blocked, ends it with ``finish_reason = "content_filter"``."""

    def __init__(self, stage: SafetyStage, call, direction: Direction):
        self.stage, self.call, self.direction = stage, call, direction
        self.scanner = StreamScanner(direction.screen)
        self.recent = ""  # text released or pending, for the classifier
        self.unclassified = 0
        self.blocked = False
        self._reported = 0

    async def chunk(self, chunk):
        started = time.perf_counter()
        try:
            if self.blocked:
                chunk.text, chunk.finish_reason = "", CONTENT_FILTER
                return chunk
            final = chunk.finish_reason is not None
            text = self.scanner.feed(chunk.text)
            if final and not self.scanner.blocked:
                text += self.scanner.finish()
            classifier = self.direction.classifier
            if classifier is not None and not self.scanner.blocked:
                self.recent = (self.recent + chunk.text)[-classifier.context_chars :]
                self.unclassified += len(chunk.text)
                if self.recent and (self.unclassified >= classifier.every_chars or final):
                    self.unclassified = 0
                    found = await self.stage._classify(self.call, classifier, [self.recent])
                    self.scanner.findings.extend(found)
                    if any(f.action == BLOCK for f in found):
                        self.scanner.blocked = True
            if self.scanner.blocked:
                self.blocked = True
                chunk.text, chunk.finish_reason = "", CONTENT_FILTER
                self._report()
                return chunk
            chunk.text = text
            if final:
                self._report()
            return chunk
        finally:
            self.stage._metrics.seconds.labels(OUTPUT).observe(time.perf_counter() - started)

    def close(self) -> None:
        """The stream ended some other way (error, the caller left): report what was found so far."""
        if not self.blocked and self._reported == 0:
            self._report()

    def _report(self) -> None:
        if self._reported:
            return
        self._reported = 1
        self.stage._decide(self.call, OUTPUT, self.scanner.findings)


__all__ = [
    "CONTENT_FILTER", "OutputStream", "POLICY_PARAMETER", "PolicyError", "SafetyPolicy", "SafetyStage", "TextSlots",
    "Verdict", "infer_texts", "policy_source", "tensor_texts",
]  # fmt: skip
