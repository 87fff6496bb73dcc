"""The LLM engine on a GPU: vLLM's async engine behind the surface the adapter uses from
``_llm_core.Engine`` (``config.default_max_tokens``, ``encode_chat``, ``encode_prompt``, ``submit``,
``snapshot``, ``start``, ``stop``, ``dtype``), and the choice between the two engines.

vLLM gives what our CPU engine implements by hand — continuous batching, paged KV, prefix caching
— with CUDA kernels. What is left for this module is what vLLM does not know: the Triton sender
(its cancellation becomes a vLLM abort), our per-request deadline (also an abort), our sampling
parameters (mapped to vLLM's), the streaming contract (vLLM's cumulative text becomes deltas and
one final response carrying the same ``info`` keys as the CPU engine) and the counters behind
``{"command": "stats"}``.

vLLM is imported lazily, so this module imports, and its logic is tested, without it. It uses the
surface that is stable from vLLM 0.6 to 0.11 in both the V0 ``AsyncLLMEngine`` and the V1
``AsyncLLM`` that name aliases: ``AsyncLLMEngine.from_engine_args(AsyncEngineArgs(...))``;
``generate(prompt, sampling_params, request_id)`` (positional: the first parameter was renamed
from ``inputs`` to ``prompt``) with a ``{"prompt_token_ids": [...]}`` prompt, an async iterator of
``RequestOutput`` whose ``outputs[0].text`` and ``.token_ids`` are cumulative, ``finish_reason``
"stop" | "length" | "abort" and ``num_cached_tokens`` (newer versions); ``await abort(request_id)``;
``shutdown()`` (V1) or ``shutdown_background_loop()`` (V0).

Threads: vLLM's asyncio loop runs on one background thread (the engine is built there: V1 starts
its output handler in the running loop); ``submit`` schedules one coroutine per request on it.
Responses go out on a second thread, so a slow Triton send never stalls vLLM's output handler,
which shares the loop with those coroutines.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # beside model.py in the Triton model directory
    from _llm_common import (
        FINISH_CANCELLED, FINISH_DEADLINE, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestError, SamplingParams, Sink,
        encode_chat, encode_prompt,
    )  # fmt: skip
except ImportError:  # in the repository (tests, tools)
    from model_repository.adapters._llm_common import (
        FINISH_CANCELLED, FINISH_DEADLINE, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestError, SamplingParams, Sink,
        encode_chat, encode_prompt,
    )  # fmt: skip

log = logging.getLogger(__name__)

ENGINES = ("auto", "vllm", "cpu")
POLL_S = 0.05  # how often a request with no new output checks its caller and deadline
_ENDED = object()  # vLLM's iterator ended


# ---- which engine ---------------------------------------------------------------------------


class EngineUnavailable(RuntimeError):
    """``engine vllm`` was asked for where vLLM cannot run."""


def vllm_unavailable() -> str | None:
    """Why vLLM cannot run in this process, or None when it can (importable, and a CUDA device).

    The cheap checks come first, so ``auto`` on a CPU machine never pays for importing vLLM."""
    reasons = []
    if importlib.util.find_spec("vllm") is None:
        reasons.append("vllm is not installed")
    try:
        import torch

        if not torch.cuda.is_available():
            reasons.append("no CUDA device is visible (torch.cuda.is_available() is False)")
    except ImportError:
        reasons.append("torch is not installed")
    if not reasons:
        try:
            importlib.import_module("vllm")
        except Exception as err:  # noqa: BLE001 - a broken install fails inside its own import
            reasons.append(f"import vllm failed ({type(err).__name__}: {err})")
    return "; ".join(reasons) or None


def choose_engine(requested: str, probe: Callable[[], str | None] = vllm_unavailable) -> str:
    """``auto``: vLLM where it can run, else the CPU engine. ``vllm``: vLLM or EngineUnavailable.
    ``cpu``: the CPU engine (vLLM is not probed). Returns "vllm" or "cpu"."""
    name = (requested or "auto").strip().lower()
    if name not in ENGINES:
        raise ValueError(f"parameter 'engine' must be one of {', '.join(ENGINES)}; got {requested!r}")
    if name == "cpu":
        return "cpu"
    reason = probe()
    if reason is None:
        return "vllm"
    if name == "vllm":
        raise EngineUnavailable(f"engine 'vllm' was asked for, but vLLM cannot run here: {reason} (use engine 'cpu' or 'auto')")
    log.info("engine auto: the CPU engine (%s)", reason)
    return "cpu"


# ---- the engine -----------------------------------------------------------------------------------


@dataclass
class VLLMConfig:
    default_max_tokens: int = 256
    gpu_memory_utilization: float = 0.9  # the share of the GPU's memory vLLM takes (weights + KV blocks)
    dtype: str = "auto"  # vLLM's own: "auto" is the checkpoint's type (16-bit for a float32 checkpoint)
    prefix_caching: bool = True


@dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    submitted: float
    deadline: float | None
    emitted: int = 0  # characters of text already sent
    completion_tokens: int = 0
    cached_tokens: int = 0
    submitted_step: int = 0
    last_step: int = -1
    first_output_at: float | None = None
    text: str = ""
    finished: bool = False


@dataclass
class _Counters:
    requests: int = 0
    running: int = 0
    tokens_generated: int = 0
    cancelled: int = 0
    deadline_exceeded: int = 0
    errors: int = 0
    aborted: int = 0  # aborts sent to vLLM (cancel, deadline)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    records: deque = field(default_factory=lambda: deque(maxlen=512))


class VLLMEngine:
    """vLLM's async engine on a background event loop, streaming to our sinks."""

    def __init__(self, model_dir: str | Path, config: VLLMConfig = VLLMConfig(), hooks: Any = None, vllm: Any = None):
        """``vllm``: the module to use (tests pass a fake); imported in ``start`` when None."""
        from transformers import AutoTokenizer

        self.config = config
        self.hooks = hooks
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.dtype = config.dtype  # the type vLLM resolved, once started
        self.max_model_len: int | None = None
        self.kv_capacity_tokens: int | None = None
        self.version: str | None = None
        self.step = 0  # outputs received from vLLM, all requests together (vLLM's own step is not exposed)
        self.counters = _Counters()
        self._vllm = vllm
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- tokenization (caller threads) --------------------------------------------------

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def encode_prompt(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    # ---- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread and build vLLM's engine on it (loads the model; raises on failure)."""
        if self._vllm is None:
            self._vllm = importlib.import_module("vllm")
        self._sender = threading.Thread(target=self._send_loop, name="vllm-responses", daemon=True)
        self._sender.start()
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=self._run_loop, args=(loop,), name="vllm-loop", daemon=True)
        self._thread.start()
        try:
            self._engine = asyncio.run_coroutine_threadsafe(self._build(), loop).result()
        except BaseException:
            self.stop()
            raise
        self._read_engine_facts()
        log.info("vLLM %s engine ready: %s, dtype %s, max_model_len %s", self.version, self.model_dir, self.dtype, self.max_model_len)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=60)
            except Exception:  # noqa: BLE001 - stopping goes on
                log.warning("vLLM shutdown failed", exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(timeout=10)

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _build(self) -> Any:
        vllm = self._vllm
        args = vllm.AsyncEngineArgs(
            model=self.model_dir,
            dtype=self.config.dtype,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            enable_prefix_caching=self.config.prefix_caching,
            disable_log_stats=True,  # our counters and Triton's metrics report instead
        )
        return vllm.AsyncLLMEngine.from_engine_args(args)

    def _read_engine_facts(self) -> None:
        """What vLLM decided at start-up, read once (V1 keeps its configs on the engine, V0 on ``.engine``)."""
        engine, inner = self._engine, getattr(self._engine, "engine", None)
        model_config = getattr(engine, "model_config", None) or getattr(inner, "model_config", None)
        vllm_config = getattr(engine, "vllm_config", None)
        cache_config = getattr(vllm_config, "cache_config", None) or getattr(inner, "cache_config", None)
        length = getattr(model_config, "max_model_len", None)
        self.max_model_len = length if isinstance(length, int) and length > 0 else None
        dtype = getattr(model_config, "dtype", None)
        if dtype is not None:
            self.dtype = str(dtype).removeprefix("torch.")
        blocks, size = getattr(cache_config, "num_gpu_blocks", None), getattr(cache_config, "block_size", None)
        if isinstance(blocks, int) and isinstance(size, int):
            self.kv_capacity_tokens = blocks * size
        self.version = str(getattr(self._vllm, "__version__", "?"))

    async def _shutdown(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        engine, self._engine = self._engine, None
        close = getattr(engine, "shutdown", None) or getattr(engine, "shutdown_background_loop", None)
        if close is not None:
            close()

    # ---- requests (caller threads) ------------------------------------------------------

    def sampling_params(self, p: SamplingParams) -> Any:
        """Ours -> vLLM's. max_tokens stays a hard cap; temperature 0 is greedy (top_p and seed
        do not apply); stop strings are cut from the text as in the CPU engine."""
        greedy = p.temperature <= 0
        return self._vllm.SamplingParams(
            n=1,
            max_tokens=p.max_tokens,
            temperature=0.0 if greedy else p.temperature,
            top_p=1.0 if greedy else p.top_p,
            seed=None if greedy else p.seed,
            stop=list(p.stop) or None,
            ignore_eos=p.ignore_eos,
            skip_special_tokens=True,
        )

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        """Schedule a request on vLLM; raises RequestError at once when it could never fit."""
        loop = self._loop
        if loop is None or self._engine is None:
            raise RuntimeError("the vLLM engine is not running")
        if not prompt:
            raise RequestError("the prompt is empty")
        need = len(prompt) + params.max_tokens
        if self.max_model_len is not None and need > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the model's "
                f"context window of {self.max_model_len} tokens"
            )
        now = time.monotonic()
        request = _Request(
            id=request_id, prompt=list(prompt), params=params, sink=sink, submitted=now,
            deadline=None if params.deadline_ms is None else now + params.deadline_ms / 1000.0,
        )  # fmt: skip
        asyncio.run_coroutine_threadsafe(self._drive(request), loop)

    def snapshot(self) -> dict[str, Any]:
        c = self.counters
        with self._lock:
            records = list(c.records)
        return {
            "engine": "vllm",
            "vllm_version": self.version,
            "dtype": self.dtype,
            "gpu_memory_utilization": self.config.gpu_memory_utilization,
            "max_model_len": self.max_model_len,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "prefix_caching": self.config.prefix_caching,
            "engine_step": self.step,
            "requests": c.requests,
            "running": c.running,
            "tokens_generated": c.tokens_generated,
            "cancelled": c.cancelled,
            "deadline_exceeded": c.deadline_exceeded,
            "errors": c.errors,
            "aborted": c.aborted,
            "prefix_prompt_tokens": c.prompt_tokens,
            "prefix_hit_tokens": c.hit_tokens,
            "prefix_hit_rate": c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "records": records,
        }

    # ---- one request (loop thread) ----------------------------------------------------------

    async def _drive(self, req: _Request) -> None:
        """Stream one request: vLLM's outputs arrive through a queue, so the caller and the
        deadline are checked on every output and, between outputs (queued, prefilling), every
        ``POLL_S``."""
        task = asyncio.current_task()
        self._tasks.add(task)
        self.counters.requests += 1
        self.counters.running += 1
        req.submitted_step = self.step
        outputs: asyncio.Queue = asyncio.Queue()
        pump = asyncio.ensure_future(self._pump(req, outputs))
        try:
            while not req.finished:
                item = await self._next(req, outputs)
                gone = self._gone(req)
                if gone is not None:
                    await self._abort(req)
                    self._finish(req, gone)
                elif item is _ENDED:
                    self._finish(req, FINISH_ERROR, error="vLLM ended the stream without a final output")
                elif isinstance(item, BaseException):
                    self._finish(req, FINISH_ERROR, error=f"{type(item).__name__}: {item}")
                elif item is not None:
                    self._output(req, item)
        except asyncio.CancelledError:  # stop(): the engine is going away
            self._finish(req, FINISH_ERROR, error="the engine stopped")
        except Exception as err:  # a bug here must not leave the caller waiting
            log.exception("vLLM request %s failed", req.id)
            await self._abort(req)
            self._finish(req, FINISH_ERROR, error=f"{type(err).__name__}: {err}")
        finally:
            pump.cancel()  # a cancelled generate() aborts in vLLM too (a no-op once finished)
            self.counters.running -= 1
            self._tasks.discard(task)

    async def _pump(self, req: _Request, outputs: asyncio.Queue) -> None:
        try:
            stream = self._engine.generate({"prompt_token_ids": req.prompt}, self.sampling_params(req.params), req.id)
            async for out in stream:
                outputs.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - vLLM refused the request or failed: the caller hears it
            outputs.put_nowait(err)
        else:
            outputs.put_nowait(_ENDED)

    @staticmethod
    async def _next(req: _Request, outputs: asyncio.Queue) -> Any:
        """The next output, or None after ``POLL_S`` (or at the deadline) without one."""
        try:
            return outputs.get_nowait()
        except asyncio.QueueEmpty:
            pass
        timeout = POLL_S
        if req.deadline is not None:
            timeout = max(0.0, min(timeout, req.deadline - time.monotonic()))
        try:
            return await asyncio.wait_for(outputs.get(), timeout)
        except TimeoutError:
            return None

    @staticmethod
    def _gone(req: _Request) -> str | None:
        if req.sink.cancelled():
            return FINISH_CANCELLED
        if req.deadline is not None and time.monotonic() >= req.deadline:
            return FINISH_DEADLINE
        return None

    async def _abort(self, req: _Request) -> None:
        if self._engine is None:
            return
        self.counters.aborted += 1
        try:
            await self._engine.abort(req.id)
        except Exception:  # noqa: BLE001 - the request is over for the caller either way
            log.warning("vLLM abort of %s failed", req.id, exc_info=True)

    def _output(self, req: _Request, out: Any) -> None:
        """Take one cumulative RequestOutput: send the new text, or finish."""
        self.step += 1
        req.last_step = self.step
        completion = out.outputs[0]
        if req.first_output_at is None:
            req.first_output_at = time.monotonic()
            req.cached_tokens = int(getattr(out, "num_cached_tokens", None) or 0)
            self.counters.prompt_tokens += len(req.prompt)
            self.counters.hit_tokens += req.cached_tokens
            if self.hooks is not None:
                self.hooks.on_prefix(len(req.prompt), req.cached_tokens)
        count = len(completion.token_ids)
        self.counters.tokens_generated += max(0, count - req.completion_tokens)
        req.completion_tokens = count
        req.text = completion.text
        reason = completion.finish_reason
        if reason is not None or out.finished:
            if reason in (FINISH_STOP, FINISH_LENGTH):
                self._finish(req, reason)
            else:  # "abort" we did not ask for, or a reason this code does not know
                self._finish(req, FINISH_ERROR, error=f"vLLM finished the request with reason {reason!r}")
            return
        visible = req.text.rstrip("\ufffd")  # an incomplete UTF-8 character waits for its next byte
        if len(visible) > req.emitted:
            info = {"step": self.step, "prompt_tokens": len(req.prompt), "completion_tokens": count}
            self._send(req, visible[req.emitted :], info, final=False)
            req.emitted = len(visible)

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        c = self.counters
        if reason == FINISH_CANCELLED:
            c.cancelled += 1
        elif reason == FINISH_DEADLINE:
            c.deadline_exceeded += 1
        elif reason == FINISH_ERROR:
            c.errors += 1
        tail = req.text[req.emitted :] if reason in (FINISH_STOP, FINISH_LENGTH) else ""
        now = time.monotonic()
        info = {
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt),
            "completion_tokens": req.completion_tokens,  # vLLM's count (it may include the EOS it sampled)
            "cached_tokens": req.cached_tokens,
            "step": self.step,  # outputs received so far, all requests: when this one ended
            "submitted_step": req.submitted_step,
            "last_step": req.last_step,  # the last output vLLM sent for it
            "queue_ms": None if req.first_output_at is None else round(req.first_output_at - req.submitted, 6) * 1000,
            "total_ms": round(now - req.submitted, 6) * 1000,
        }
        if error:
            info["error"] = error
        with self._lock:
            c.records.append({"id": req.id, **info})
        if self.hooks is not None:
            self.hooks.on_finish(reason, len(req.prompt), req.completion_tokens)
        self._send(req, tail, info, final=True)

    # ---- responses (sender thread) ------------------------------------------------------------

    def _send(self, req: _Request, text: str, info: dict[str, Any], final: bool) -> None:
        self._outbox.put((req, text, info, final))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            req, text, info, final = item
            try:
                req.sink.send(text, info, final)
            except Exception:  # noqa: BLE001 - the caller is gone (Triton refuses responses to a cancelled request)
                log.debug("response to %s not delivered", req.id, exc_info=True)
