"""Triton Python-backend model (decoupled): streaming generation from a continuous-batching engine.

The ``engine`` parameter picks it: ``auto`` (default) runs vLLM (``_vllm_core``: vLLM's OpenAI
server from its own environment, found by the ``vllm_python`` parameter or ``$INFERPLANE_VLLM_PYTHON``)
where that environment exists, our CPU engine (``_llm_core``) otherwise; ``vllm`` fails to load
without it; ``cpu`` always runs ours. Both take the same requests and send the same
responses, so the frontend does not know which one runs.

Inputs (all BYTES ``[1]``, optional): ``text_input`` (a raw prompt), ``messages`` (a JSON list of
``{role, content}``, rendered with the model's chat template), ``parameters`` (JSON: max_tokens,
temperature, top_p, seed, stop, ignore_eos, deadline_ms; or ``{"command": "stats"}``). The request
parameter ``inferplane_priority`` (set by the frontend from the caller's plan) orders the engine's queue.
Outputs per response: ``text_output`` (the new text) and ``info`` (JSON). Responses stream one per
token group; the last one carries the FINAL flag and ``info.finish_reason`` (stop | length |
cancelled | deadline | error) with prompt/completion/cached token counts and the engine's step.

``execute`` only parses and queues; the engine thread sends every response.
"""

import json
import logging
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from _common import MAX_ERROR_CHARS, ArtifactMismatch, verify_artifact
from _llm_common import RequestError, SamplingParams, request_adapter, request_priority
from _lora import NOT_FOUND_PREFIX, AdapterError, AdapterIndex, AdapterNotFound
from _vllm_core import EngineUnavailable, choose_engine, find_vllm_python, has_cuda, vllm_unavailable

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger(__name__)


def _error(message, code_name="INVALID_ARG"):
    """A fresh TritonError for one response (never share one between responses: see _common.error_response)."""
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + f"... ({len(message) - MAX_ERROR_CHARS} more characters)"
    code = getattr(pb_utils.TritonError, code_name, None)
    try:
        return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    except TypeError:  # an older stub: message only
        return pb_utils.TritonError(message)


def _fail(sender, message, code_name):
    """The final error response of one request; a sender that refuses (the caller left) is let go."""
    try:
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_error(message, code_name)), flags=FINAL)
    except Exception:  # noqa: BLE001 - the request is gone; nothing left to tell
        log.warning("could not send the error of a request: %s", message[:200])


def _response(text, info):
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("info", np.array([json.dumps(info).encode("utf-8")], dtype=np.object_)),
        ]
    )


class _Sink:
    __slots__ = ("sender",)

    def __init__(self, sender):
        self.sender = sender

    def send(self, text, info, final):
        if final and info.get("finish_reason") == "error" and "error" in info:
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_error(info["error"])), flags=FINAL)
            return
        if final and info.get("finish_reason") == "cancelled":
            self.sender.send(flags=FINAL)
            return
        self.sender.send(_response(text, info), flags=FINAL if final else 0)

    def cancelled(self):
        return self.sender.is_cancelled()


class _Hooks:
    """Engine counters as Triton custom metrics (Triton's /metrics), updated per request, not per step."""

    def __init__(self, model_name):
        labels = {"model": model_name}
        counter = pb_utils.MetricFamily.COUNTER
        # the families must outlive their metrics: keep them on the object
        self.families = [
            pb_utils.MetricFamily("inferplane_llm_prompt_tokens_total", "Prompt tokens prefilled", counter),
            pb_utils.MetricFamily(
                "inferplane_llm_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache", counter
            ),
            pb_utils.MetricFamily("inferplane_llm_completion_tokens_total", "Tokens generated", counter),
            pb_utils.MetricFamily("inferplane_llm_sequences_total", "Finished sequences by finish reason", counter),
        ]
        self.prompt, self.hit, self.completion = (f.Metric(labels) for f in self.families[:3])
        reasons = ("stop", "length", "cancelled", "deadline", "error")
        self.finished = {r: self.families[3].Metric({**labels, "reason": r}) for r in reasons}

    def on_prefix(self, prompt_tokens, hit_tokens):
        self.prompt.increment(prompt_tokens)
        if hit_tokens:
            self.hit.increment(hit_tokens)

    def on_finish(self, reason, prompt_tokens, completion_tokens):
        self.completion.increment(completion_tokens)
        self.finished.get(reason, self.finished["error"]).increment(1)


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise RequestError(f"input {name} must hold exactly one element")
    value = value[0]
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(f"input {name} is not valid UTF-8 (byte {err.start})") from None


def _cpu_engine(model_dir, params, hooks):
    from _llm_core import Engine, EngineConfig

    config = EngineConfig(
        threads=int(params.get("threads") or 1),
        kv_cache_memory=params.get("kv_cache_memory") or "1GiB",
        max_running=int(params.get("max_running") or 16),
        max_prefill_tokens=int(params.get("max_prefill_tokens") or 4096),
        default_max_tokens=int(params.get("default_max_tokens") or 256),
        prefix_cache_tokens=int(params.get("prefix_cache_tokens") or 0),
        prefix_block=int(params.get("prefix_block") or 16),
        dtype=params.get("dtype") or "float32",
        max_loras=int(params.get("max_loras") or 0),
        max_lora_rank=int(params.get("max_lora_rank") or 16),
    )
    return Engine(model_dir, config, hooks=hooks)


def _vllm_engine(model_dir, params, hooks, name):
    """vLLM's OpenAI server from its own environment (``_vllm_core``): our scheduler settings map to
    its own (max_running -> max_num_seqs, max_prefill_tokens -> max_num_batched_tokens,
    kv_cache_memory -> its CPU KV cache, prefix_cache_tokens 0 -> no prefix caching)."""
    from kv_budget import parse_memory
    from _llm_common import native_cpu_dtype
    from _vllm_core import VLLMConfig, VLLMEngine, find_vllm_python

    dtype = params.get("dtype") or "auto"
    if dtype == "auto":
        dtype = "bfloat16" if has_cuda() else native_cpu_dtype()
    config = VLLMConfig(
        python=find_vllm_python(params.get("vllm_python", "")),
        served_name=name,
        default_max_tokens=int(params.get("default_max_tokens") or 256),
        dtype=dtype,
        prefix_caching=int(params.get("prefix_cache_tokens") or 4096) > 0,
        threads=int(params.get("vllm_threads") or 0),
        kv_cache_bytes=parse_memory(params.get("kv_cache_memory") or "1GiB"),
        gpu_memory_utilization=float(params.get("gpu_memory_utilization") or 0.9),
        max_num_seqs=int(params.get("max_running") or 16),
        max_num_batched_tokens=int(params.get("max_prefill_tokens") or 4096),
        max_model_len=int(params.get("max_model_len") or 0),
        enforce_eager=(params.get("vllm_enforce_eager") or "").lower() in ("1", "true", "yes"),
        speculative=params.get("speculative") or "",
        spec_tokens=int(params.get("spec_tokens") or 4),
        spec_max_batch=int(params.get("spec_max_batch") or 0),
        max_loras=int(params.get("max_loras") or 0),
        max_lora_rank=int(params.get("max_lora_rank") or 16),
        tensor_parallel=max(1, int(params.get("tensor_parallel") or 1)),
    )
    return VLLMEngine(model_dir, config, hooks=hooks)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the LLM engine needs model_transaction_policy { decoupled: true }")
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        artifact = params.get("artifact", "hf")
        if not artifact or Path(artifact).name != artifact:
            raise pb_utils.TritonModelException(f"parameter 'artifact' must be a folder name, got {artifact!r}")
        model_dir = version_dir / artifact
        try:
            verify_artifact(model_dir / "model.safetensors", params.get("artifact_sha256", ""))
        except ArtifactMismatch as err:
            raise pb_utils.TritonModelException(str(err)) from None
        try:
            python = find_vllm_python(params.get("vllm_python", ""))
            lora_on_cpu = int(params.get("max_loras") or 0) > 0 and not has_cuda()
            choice = choose_engine(params.get("engine") or "auto", lambda: vllm_unavailable(python), lora_on_cpu=lora_on_cpu)
        except (EngineUnavailable, ValueError) as err:
            raise pb_utils.TritonModelException(str(err)) from None
        try:
            hooks = _Hooks(args["model_name"])
        except Exception:  # noqa: BLE001 - metrics are optional (older stubs)
            hooks = None
        # LoRA adapters installed beside the model (model_repository/lora.py), checked against these base weights
        self.adapters = AdapterIndex(Path(args["model_repository"]), params.get("artifact_sha256", ""))
        if choice == "vllm":
            self.engine = _vllm_engine(model_dir, params, hooks, args["model_name"])
        else:
            self.engine = _cpu_engine(model_dir, params, hooks)
        try:
            self.engine.start()
        except Exception as err:  # the model fails to load, saying why (vLLM's log tail included)
            raise pb_utils.TritonModelException(f"the {choice} engine did not start: {type(err).__name__}: {err}") from None

    def execute(self, requests):
        """Each request on its own: one that fails (its own mistake or not) answers only itself."""
        for request in requests:
            try:
                sender = request.get_response_sender()
            except Exception:  # noqa: BLE001 - no way to answer this one; the others still go
                log.exception("no response sender for a request")
                continue
            try:
                self._submit(request, sender)
            except AdapterNotFound as err:  # the frontend maps this prefix to NOT_FOUND
                _fail(sender, f"{NOT_FOUND_PREFIX}{err}", "NOT_FOUND")
            except AdapterError as err:  # installed but unusable (its digest, its base): the operator's to fix
                _fail(sender, str(err), "INTERNAL")
            except RequestError as err:  # the frontend maps this prefix to INVALID_ARGUMENT
                _fail(sender, f"invalid request: {err}", "INVALID_ARG")
            except BaseException as err:  # noqa: BLE001 - one bad request must not take the model down
                if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                    raise
                _fail(sender, f"{type(err).__name__}: {err}", "INTERNAL")
        return None

    def _submit(self, request, sender):
        raw = _input(request, "parameters")
        try:
            doc = json.loads(raw) if raw else {}
        except ValueError:
            raise RequestError("parameters must be a JSON object") from None
        if not isinstance(doc, dict):
            raise RequestError("parameters must be a JSON object")
        if doc.get("command") == "stats":
            sender.send(_response("", {**self.engine.snapshot(), "adapters": self.adapters.names()}), flags=FINAL)
            return
        messages, prompt = _input(request, "messages"), _input(request, "text_input")
        if (messages is None) == (prompt is None):
            raise RequestError("send exactly one of text_input and messages")
        if messages is not None:
            try:
                ids = self.engine.encode_chat(json.loads(messages))
            except RequestError:
                raise
            except ValueError as err:
                raise RequestError(f"messages: {err}") from None
        else:
            ids = self.engine.encode_prompt(prompt)
        params = SamplingParams.parse(doc, self.engine.config.default_max_tokens)
        try:  # the frontend's, from the caller's plan and grants (never the caller's own JSON)
            parameters = request.parameters()
        except AttributeError:  # an older stub without request parameters
            parameters = ""
        params.priority = request_priority(parameters)
        adapter = request_adapter(parameters)
        if adapter:
            params.adapter = self.adapters.lookup(adapter)
            if params.adapter.rank > self.engine.config.max_lora_rank:
                raise RequestError(f"adapter {adapter!r} has rank {params.adapter.rank}; this model serves ranks up to {self.engine.config.max_lora_rank} (max_lora_rank)")
        request_id = request.request_id() or uuid.uuid4().hex
        self.engine.submit(f"{request_id}-{uuid.uuid4().hex[:8]}", ids, params, _Sink(sender))

    def finalize(self):
        self.engine.stop()
