"""Triton in the frontend's own process, through its C API: a drop-in for ``TritonClient``.

``InProcessTriton`` is a ``server.dataplane.backend.Backend`` like ``TritonClient`` plus the fast paths
``infer(pb.ModelInferRequest) -> pb.ModelInferResponse`` and ``infer_tensors`` (one Triton
request from buffers the caller owns, several buffers per input allowed: a merged batch costs no
copy on the way in). Every answer is what Triton's gRPC frontend would have sent for the same
request (``server.runtime.capi_codec`` mirrors its conversions); every failure is a domain error.

Lifecycle: :meth:`InProcessTriton.start` builds the server from the options the supervisor gives
the ``tritonserver`` process (repository, explicit model control, strict model config, backend
directory with the Python backend and this interpreter's stub, cache directory and
``local,size=...`` response cache, the Python backend's ``shm-region-prefix-name``, exit timeout,
strict readiness off). :meth:`stop` unloads every model (their stubs finalize and exit), stops
and deletes the server, and removes what is left: no stub processes, no ``/dev/shm`` regions.

How a request travels:

* On the event loop: one ``TRITONSERVER_InferenceRequest`` per call, inputs pointed at the
  caller's bytes (``AppendInputData``, zero copy; the Python objects stay referenced until Triton's
  request-release callback), then ``ServerInferAsync``: about a dozen cffi calls per request
  (~0.25 us each uncontended; each lets the GIL go and takes it back). Tried and dropped: the calls
  on objects only this process holds through ``ctypes.PyDLL``, which keeps the GIL. It was 1.7x
  less loop time per request on an overloaded 2-core machine (150-160 against 247-285 us, 4000
  requests at once), no better on a quiet one (84 against 75 us, median of 5) nor through sockets
  at c=32 (medians 1439 against 1590 req/s, noise larger than the difference), and keeping the GIL
  makes Triton's threads wait longer in our callbacks.
* On Triton's threads, three tiny callbacks and **no C calls**: the allocator hands Triton the
  storage of a fresh Python ``bytes`` object (``PyBytes_FromStringAndSize(NULL, n)`` through
  ``ctypes.pythonapi``, which keeps the GIL), the response callback does one
  ``loop.call_soon_threadsafe`` per Triton response (a merged batch costs one hop), and the
  request-release callback appends to a deque and posts one sweep for all the releases that come
  before the loop runs it (requests must be deleted promptly: a request holds a reference to its
  model, and an unload waits for it). Each callback still takes the GIL from a Triton thread:
  three hand-overs per Triton request. Measured with ``loadtest/bench_inprocess.py`` on a busy
  2-core machine, a request per caller costs more CPU per request (0.74 against 0.63 ms, process
  trees with their stubs) and gets no more throughput than a grpc.aio hop to a Triton process;
  Triton then also runs smaller batches (2.5 rows per execution), which makes the stub's share
  per row larger. Merged requests (``infer_tensors``, one call for many callers) are where
  in-process Triton pays off: the hand-overs, C calls and stub executions are per call.
  Removing the GIL from Triton's threads entirely needs callbacks written in C (cffi's API mode:
  a compiler at install time).
* Back on the loop: the response is read (outputs are those ``bytes``: one copy when they go into
  a protobuf message or a serialized answer), then deleted.

Failure story:

* **A model's Python stub dies** (``kill -9``, a segfault in a framework): Triton 2.51's Python
  backend does not restart it; the model stays READY, and every request to it fails after about
  a second with ``INTERNAL: ... Stub process '<instance>' is not healthy``. This object recognizes
  that answer (``capi_codec.is_stub_death``), answers ``UNAVAILABLE`` with a 1 s retry hint —
  not INTERNAL: the request was valid and will succeed shortly, which is what UNAVAILABLE means
  to a client's retry policy — fails further requests to that model fast while it reloads the
  model (unload, then load: a load of a model already loaded from unchanged files does nothing),
  and serves again within ~2 s. Other models and the process are not affected. What stays behind
  (a Triton 2.51 Python-backend bug; the ``tritonserver`` process does the same): the requests the
  stub held when it died leak their response factories, so the old instance never finishes
  unloading; its threads idle until the process ends, its stub stays a zombie until :meth:`stop`
  reaps it, and :meth:`stop` then does not delete the server (deleting it under that instance's
  threads crashed the process 1 run in 5) — after a stub death, let the worker exit and restart
  rather than start another in-process Triton in it.
* **Triton's core crashes** (a segfault or abort in libtritonserver or a backend library loaded
  into it): it is this process; the worker dies with every request it holds. Nothing in-process
  can catch that. The parent must supervise the worker (restart it, as ``WorkerPool`` restarts
  workers and ``TritonSupervisor`` restarted the Triton process) while other workers keep
  serving; the stubs notice their parent is gone within ~0.3 s and exit, and the next start
  removes ``inferplane_<dead pid>_*`` shm regions (``supervisor.remove_shm_regions``).

Things to know about running Triton here: the Python backend forks (``fork`` + ``execvp bash``,
and ``system()``) from this multi-threaded process to start each stub, so stubs are children of
the frontend, in its process group (a terminal's Ctrl-C reaches them; they ignore SIGINT), and
they read ``PATH``/``LD_LIBRARY_PATH``/``OMP_NUM_THREADS`` from this process's environment, which
:meth:`start` sets (``capi.prepare_process_environment``) and :meth:`stop` gives back. Nothing here
may reap children it did not start (``waitpid(-1)``, ``SIGCHLD`` ignored): the backend waits for
its stubs by pid (asyncio's default child watcher and uvloop wait by pid too). grpc's fork
handlers see the backend's ``fork`` and skip themselves ("Other threads are currently calling into
gRPC, skipping fork() handlers" on stderr); the child only ``exec``s. libtritonserver installs no
signal handlers (``SigCgt`` unchanged). Starting the server adds ~8 threads, each loaded
Python-backend model ~30 more (most idle). One server per process: libtritonserver keeps
process-wide state (a second server with a response cache is refused: "TritonCacheManager already
holds a cache").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

from google.protobuf.message import DecodeError

from server.dataplane.backend import DOWN, LIVE
from server.errors import BackendError, BackendUnavailable, DeadlineExceeded, InferplaneError, InvalidRequest, Unimplemented
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inference import model_config_pb2
from server.runtime import capi, capi_codec
from server.runtime.capi import ffi
from server.runtime.capi_codec import RequestPlan, Tensor
from server.runtime.inprocess_batch import CODEC, MergedBatch
from server.runtime.inprocess_call import CPU, FINAL_PARAMETER, InferResult, Output, _Call, _parameter_value, callbacks
from server.runtime.inprocess_stream import InProcessStream
from server.runtime.inprocess_unary import UNARY
from server.runtime.supervisor import _is_dead, kill_stale_stubs, remove_shm_regions
from server.runtime.triton_install import TritonInstallation

__all__ = ["FINAL_PARAMETER", "InProcessTriton", "InProcessStream", "InferResult", "Output", "Tensor"]

log = logging.getLogger(__name__)

_FINAL = capi.RESPONSE_COMPLETE_FINAL
_DTYPE = capi.DATATYPE_BY_NAME
_DTYPE_NAME = capi.DATATYPE_NAMES
UNLOAD_WAIT_S = 0.5  # how long a reload waits for the dead stub's instance to unload (it will not: see _reload)
_generation = 0  # servers started by this process (the shm prefix names each)

_running: "InProcessTriton | None" = None  # the one server this process runs
_kept: list = []  # stopped servers that must never be deleted (see InProcessTriton.stop)
SKIP_DELETE = False  # tests and experiments: keep every stopped server


class InProcessTriton:
    """One in-process Triton server. Use it from the event loop it was started on."""

    target = "in-process"  # what TritonClient.target names (breakers and logs use it)

    def __init__(self, library: capi.Library, server, *, repository: Path, workdir: Path, shm_prefix: str, exit_timeout_s: int, heal_stubs: bool):
        self._library = library
        self._lib = library.lib
        self._server = server
        self.repository = repository
        self.workdir = workdir
        self.shm_prefix = shm_prefix
        self.exit_timeout_s = exit_timeout_s
        self.heal_stubs = heal_stubs
        self._loop = asyncio.get_running_loop()
        # requests Triton gave back: the loop deletes them soon (a request holds its model: an
        # unload waits until every request of the model is deleted)
        self._released: collections.deque[_Call] = collections.deque()
        self._sweep_posted = False
        self._live: set[_Call] = set()
        self._decoupled: dict[tuple[str, int], bool] = {}
        self._names: dict[str, bytes] = {}
        self._healing: dict[str, asyncio.Task] = {}
        self._last_heal: dict[str, float] = {}
        self._stopped = False
        self._environment: dict[str, str | None] = {}  # what start() changed in os.environ
        self.stub_restarts = 0
        self.leaked_instances = 0  # instances of dead stubs that never finished unloading (see _reload)
        allocator = ffi.new("TRITONSERVER_ResponseAllocator**")
        self._hooks = hooks = callbacks(library)
        library.check(self._lib.TRITONSERVER_ResponseAllocatorNew(allocator, hooks.alloc, hooks.release_buffer, ffi.NULL))
        self._allocator = allocator[0]
        # the out-parameters of response reads: only ever used on the loop thread
        self._out = ffi.new("inferplane_output_t*")
        self._out_ptrs = [ffi.addressof(self._out[0], f) for f in ("name", "datatype", "shape", "dim_count", "base", "byte_size", "memory_type", "memory_type_id", "userp")]
        self._name_p, self._version_p, self._count_p = ffi.new("const char**"), ffi.new("int64_t*"), ffi.new("uint32_t*")
        self._ptype_p, self._pvalue_p = ffi.new("int*"), ffi.new("const void**")

    # ---- lifecycle ----------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        repository: Path,
        workdir: Path,
        *,
        response_cache_bytes: int = 64 << 20,
        startup_timeout: float = 60.0,
        models: tuple[str, ...] = (),
        install: TritonInstallation | None = None,
        exit_timeout_s: int = 5,
        log_verbose: int = 0,
        metrics: bool = False,
        heal_stubs: bool = True,
    ) -> "InProcessTriton":
        """Start Triton in this process with the supervisor's options, then load ``models``."""
        global _generation, _running

        if _running is not None and not _running._stopped:
            # libtritonserver keeps process-wide state (the response cache manager, the backends)
            raise RuntimeError("one in-process Triton per process: stop the running one first")

        install = install or TritonInstallation.find()
        repository, workdir = Path(repository).resolve(), Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        kill_stale_stubs(_is_dead)  # what a frontend killed before it could clean up left behind
        remove_shm_regions(_is_dead)
        environment = capi.prepare_process_environment(install)
        library = capi.load_library(install)
        _generation += 1
        shm_prefix = f"inferplane_{os.getpid()}_capi{_generation}_"
        backends = install.prepare_backends(workdir)
        options = capi.ServerOptions(
            repository=repository,
            backends=backends,
            repoagents=install.root / "repoagents",
            caches=install.caches,
            response_cache_bytes=response_cache_bytes,
            python_shm_prefix=shm_prefix,
            exit_timeout_s=exit_timeout_s,
            log_file=workdir / "triton.log",
            log_verbose=log_verbose,
            metrics=metrics,
        )
        try:
            server = await asyncio.wait_for(asyncio.to_thread(options.new_server, library), startup_timeout)
        except capi.TritonError as err:
            capi.restore_process_environment(environment)
            raise BackendUnavailable(f"in-process Triton did not start: {err.message}") from None
        except BaseException:
            capi.restore_process_environment(environment)
            raise
        triton = _running = cls(library, server, repository=repository, workdir=workdir, shm_prefix=shm_prefix, exit_timeout_s=exit_timeout_s, heal_stubs=heal_stubs)
        triton._environment = environment
        try:
            for name in models:
                await triton.load_model(name, timeout=startup_timeout)
        except BaseException:
            await triton.stop()
            raise
        return triton

    def connect(self) -> None:
        """Nothing to connect (``TritonClient.connect`` parity)."""

    async def close(self) -> None:
        """``TritonClient.close`` parity: the in-process server stops with its client."""
        await self.stop()

    async def stop(self) -> None:
        """Unload every model, stop and delete the server; leave no stubs and no shm regions."""
        if self._stopped:
            return
        self._stopped = True
        for task in self._healing.values():
            task.cancel()
        lib, server = self._lib, self._server
        try:
            index = json.loads(self._library.message_json(lambda out: lib.TRITONSERVER_ServerModelIndex(server, 0, out)))
            for entry in index:
                if entry.get("state") in ("READY", "LOADING"):
                    await asyncio.to_thread(lib.TRITONSERVER_ServerUnloadModel, server, entry["name"].encode())
            if self.leaked_instances:  # they never unload: do not wait the whole exit timeout for them
                self._library.take_error(lib.TRITONSERVER_ServerSetExitTimeout(server, 1))
            deadline = time.monotonic() + (1 if self.leaked_instances else self.exit_timeout_s)
            while time.monotonic() < deadline:  # unload returns at once; the stubs finalize meanwhile
                index = json.loads(self._library.message_json(lambda out: lib.TRITONSERVER_ServerModelIndex(server, 0, out)))
                if not any(e.get("state") in ("READY", "LOADING", "UNLOADING") for e in index):
                    break
                await asyncio.sleep(0.05)
        except capi.TritonError as err:
            log.warning("unloading models before stop failed: %s", err)
        err = await asyncio.to_thread(lib.TRITONSERVER_ServerStop, server)  # waits for what is in flight
        if (problem := self._library.take_error(err)) is not None:
            log.warning("TRITONSERVER_ServerStop: %s", problem)
        for _ in range(3):  # the responses Triton posted meanwhile: read and delete them while it exists
            await asyncio.sleep(0)
        for call in list(self._live):  # what never completes now fails at once
            self._fail(call, BackendUnavailable("the in-process Triton stopped", retry_after_s=1.0))
        self._sweep()
        if self.leaked_instances or SKIP_DELETE:
            # A model instance that never unloaded (a dead stub's, see _reload) still runs its
            # threads: deleting the server under them crashes the process, at once or at exit
            # (seen 1 run in 5). The stopped server is kept instead, never freed.
            log.warning("not deleting the in-process Triton: %d model instance(s) of dead stubs never unloaded", self.leaked_instances)
            _kept.append((server, self._allocator))
        else:
            err = await asyncio.to_thread(lib.TRITONSERVER_ServerDelete, server)
            if (problem := self._library.take_error(err)) is not None:
                log.warning("TRITONSERVER_ServerDelete: %s", problem)
            self._library.take_error(lib.TRITONSERVER_ResponseAllocatorDelete(self._allocator))
        self._kill_own_stubs()
        self._remove_own_shm()
        capi.restore_process_environment(self._environment)  # no more stubs to start

    def _kill_own_stubs(self) -> list[int]:
        """SIGKILL and reap this server's stub processes that are still there: live ones (found by
        the shm prefix on their command line) and zombies (a dead stub whose instance never
        unloaded is never waited for by the backend; a zombie keeps its name, not its argv)."""
        killed = []
        prefix = self.shm_prefix.encode()
        me = os.getpid()
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            state, ppid = rest[0], int(rest[1])
            ours = argv and argv[0].endswith(b"triton_python_backend_stub") and any(a.startswith(prefix) for a in argv[1:])
            zombie_stub = state == "Z" and ppid == me and comm == "triton_python_b"  # comm: 15 characters
            if not (ours or zombie_stub):
                continue
            pid = int(entry.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            if ppid == me:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, 0)
        return killed

    def _remove_own_shm(self, shm: Path = Path("/dev/shm")) -> list[str]:
        removed = []
        for region in shm.glob(self.shm_prefix + "*"):
            with contextlib.suppress(OSError):
                region.unlink()
                removed.append(region.name)
        return removed

    # ---- control ------------------------------------------------------------------------------

    def _json(self, produce):
        try:
            return json.loads(self._library.message_json(produce))
        except capi.TritonError as err:
            raise capi_codec.domain_error(err.code, err.message) from None

    def _check_running(self) -> None:
        if self._stopped:
            raise BackendUnavailable("the in-process Triton is stopped", retry_after_s=1.0)

    async def server_live(self, timeout: float = 1.0) -> bool:
        if self._stopped:
            return False
        flag = ffi.new("bool*")
        return self._library.take_error(self._lib.TRITONSERVER_ServerIsLive(self._server, flag)) is None and bool(flag[0])

    async def liveness(self, timeout: float = 1.0) -> str:
        return LIVE if await self.server_live(timeout) else DOWN

    async def server_ready(self, timeout: float = 1.0) -> bool:
        if self._stopped:
            return False
        flag = ffi.new("bool*")
        return self._library.take_error(self._lib.TRITONSERVER_ServerIsReady(self._server, flag)) is None and bool(flag[0])

    async def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        return self._model_config(name, version).config

    def _model_config(self, name: str, version: str = "") -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse.FromString(self._model_config_bytes(name, version))

    def _model_config_bytes(self, name: str, version: str = "") -> bytes:
        self._check_running()
        v = capi_codec.parse_version(version)
        return capi_codec.model_config_bytes(self._json(lambda out: self._lib.TRITONSERVER_ServerModelConfig(self._server, name.encode(), v, 1, out)))

    async def repository_index(self, ready_only: bool = False) -> list:
        return list(self._repository_index(ready_only).models)

    def _repository_index(self, ready_only: bool = False) -> pb.RepositoryIndexResponse:
        self._check_running()
        flags = capi.INDEX_FLAG_READY if ready_only else 0
        return capi_codec.repository_index(self._json(lambda out: self._lib.TRITONSERVER_ServerModelIndex(self._server, flags, out)))

    async def load_model(self, name: str, timeout: float = 300.0, *, config: dict | str | None = None) -> None:
        """Load (or reload) ``name``; ``config`` (JSON text or dict) overrides its config.pbtxt."""
        self._check_running()
        lib = self._lib
        if config is None:
            work = asyncio.to_thread(lib.TRITONSERVER_ServerLoadModel, self._server, name.encode())
        else:
            text = (config if isinstance(config, str) else json.dumps(config)).encode()
            param = lib.TRITONSERVER_ParameterNew(b"config", capi.PARAMETER_STRING, text)
            params = ffi.new("const TRITONSERVER_Parameter*[1]", [param])

            def load():
                try:
                    return lib.TRITONSERVER_ServerLoadModelWithParameters(self._server, name.encode(), params, 1)
                finally:
                    lib.TRITONSERVER_ParameterDelete(param)

            work = asyncio.to_thread(load)
        try:
            err = await asyncio.wait_for(work, timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"loading model '{name}' took longer than {timeout:.0f} s (it goes on in the background)") from None
        self._forget(name)
        if (problem := self._library.take_error(err)) is not None:
            raise capi_codec.domain_error(problem.code, problem.message)

    async def unload_model(self, name: str, timeout: float = 60.0) -> None:
        self._check_running()
        err = await asyncio.wait_for(asyncio.to_thread(self._lib.TRITONSERVER_ServerUnloadModel, self._server, name.encode()), timeout)
        self._forget(name)
        if (problem := self._library.take_error(err)) is not None:
            raise capi_codec.domain_error(problem.code, problem.message)

    async def wait_unloaded(self, name: str, timeout: float = 60.0) -> None:
        """Wait until ``name`` is no longer loaded or unloading (an unload returns at once)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [m.state for m in self._repository_index().models if m.name == name]
            if not any(state in ("READY", "LOADING", "UNLOADING") for state in states):
                return
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"model '{name}' did not unload within {timeout:.0f} s")
            await asyncio.sleep(0.05)

    def _forget(self, name: str) -> None:
        for key in [k for k in self._decoupled if k[0] == name]:
            del self._decoupled[key]

    async def model_metadata(self, name: str, version: str = "") -> pb.ModelMetadataResponse:
        self._check_running()
        v = capi_codec.parse_version(version)
        return capi_codec.model_metadata(self._json(lambda out: self._lib.TRITONSERVER_ServerModelMetadata(self._server, name.encode(), v, out)))

    async def model_statistics(self, name: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        return pb.ModelStatisticsResponse.FromString(self.statistics(name, version))

    def statistics(self, name: str = "", version: str = "") -> bytes:
        self._check_running()
        v = capi_codec.parse_version(version)
        return capi_codec.model_statistics(self._json(lambda out: self._lib.TRITONSERVER_ServerModelStatistics(self._server, name.encode(), v, out)))

    def metrics_text(self) -> str:
        """Triton's Prometheus metrics (start with ``metrics=True``)."""
        self._check_running()
        lib, holder = self._lib, ffi.new("TRITONSERVER_Metrics**")
        self._library.check(lib.TRITONSERVER_ServerMetrics(self._server, holder))
        try:
            base, size = ffi.new("const char**"), ffi.new("size_t*")
            self._library.check(lib.TRITONSERVER_MetricsFormatted(holder[0], capi.METRIC_PROMETHEUS, base, size))
            return ffi.unpack(base[0], size[0]).decode()
        finally:
            lib.TRITONSERVER_MetricsDelete(holder[0])

    async def unary_raw(self, method: str, request: bytes, timeout: float | None = 30.0) -> bytes:
        """A serialized GRPCInferenceService request in, the serialized answer out (TritonClient parity)."""
        handler = UNARY.get(method)
        if handler is None:
            raise Unimplemented(f"method '{method}' is not offered by the in-process Triton")
        request_type, run = handler
        try:
            message = request_type.FromString(request)
        except DecodeError as err:
            raise InvalidRequest(f"malformed {request_type.__name__}: {err}") from None
        answer = await run(self, message, timeout)
        return answer if isinstance(answer, bytes) else answer.SerializeToString()

    # ---- inference ----------------------------------------------------------------------------

    # ---- what the data plane's coalescer calls (batching/coalescer.py) ----------------------

    def batch_codec(self):
        """Merged batches as one request over the members' own buffers (``inprocess_batch``)."""
        return CODEC

    async def send_batch(self, payload, timeout: float | None, request: pb.ModelInferRequest | None = None):
        """A lone request (its bytes; ``request``, when given, is the same request parsed) or a merged batch."""
        if isinstance(payload, MergedBatch):
            return await self.infer_tensors(payload.model, payload.tensors, model_version=payload.version, outputs=payload.outputs, timeout=timeout)
        if request is None:
            return await self.infer_raw(payload, timeout)
        return await self.infer_bytes(request, timeout)

    async def infer_raw(self, request: bytes, timeout: float | None = None, *, model: str = "") -> bytes:
        try:
            message = pb.ModelInferRequest.FromString(request)
        except DecodeError as err:
            raise InvalidRequest(f"malformed ModelInferRequest: {err}") from None
        return (await self._infer_plan(capi_codec.request_plan(message), timeout)).to_bytes()

    async def infer(self, request: pb.ModelInferRequest, timeout: float | None = None) -> pb.ModelInferResponse:
        """The parsed request in (its ``raw_input_contents`` go to Triton as they are), the answer out."""
        return (await self._infer_plan(capi_codec.request_plan(request), timeout)).to_message()

    async def infer_bytes(self, request: pb.ModelInferRequest, timeout: float | None = None) -> bytes:
        """The parsed request in, the serialized ModelInferResponse out (what a raw-bytes gRPC
        handler returns; the outputs are copied once, into the answer)."""
        return (await self._infer_plan(capi_codec.request_plan(request), timeout)).to_bytes()

    async def infer_tensors(
        self,
        model_name: str,
        inputs: list[Tensor],
        *,
        model_version: str = "",
        request_id: str = "",
        outputs: tuple[str, ...] = (),
        timeout: float | None = None,
    ) -> InferResult:
        """One Triton request from buffers the caller owns: each input's ``chunks`` are read in order
        (a merged batch: one chunk per caller, no copy). The outputs come back whole."""
        plan = RequestPlan(model_name, capi_codec.parse_version(model_version), request_id, inputs=inputs, outputs=list(outputs))
        return await self._infer_plan(plan, timeout)

    async def _infer_plan(self, plan: RequestPlan, timeout: float | None) -> InferResult:
        self._refuse_if_healing(plan.model_name)
        if self._is_decoupled(plan.model_name, plan.model_version):
            raise Unimplemented("ModelInfer RPC doesn't support models with decoupled transaction policy")
        call = _Call(self, plan)
        call.future = self._loop.create_future()
        self._submit(call)
        if timeout is not None:
            call.timer = self._loop.call_later(max(timeout, 0.0), self._expire, call)
        try:
            return await call.future
        except asyncio.CancelledError:
            self._cancel(call)
            raise

    def _is_decoupled(self, name: str, version: int) -> bool:
        key = (name, version)
        known = self._decoupled.get(key)
        if known is None:
            flags = ffi.new("uint32_t*")
            err = self._library.take_error(self._lib.TRITONSERVER_ServerModelTransactionProperties(self._server, self._name(name), version, flags, ffi.NULL))
            if err is not None:
                raise capi_codec.domain_error(err.code, err.message)
            known = self._decoupled[key] = bool(flags[0] & capi.TXN_DECOUPLED)
        return known

    def _name(self, name: str) -> bytes:
        encoded = self._names.get(name)
        if encoded is None:
            encoded = self._names[name] = name.encode()
        return encoded

    def _submit(self, call: _Call) -> None:
        """Build the C request for ``call.plan`` and hand it to Triton (raises a domain error)."""
        self._check_running()
        if self._released:
            self._sweep()
        lib, plan = self._lib, call.plan
        holder = ffi.new("TRITONSERVER_InferenceRequest**")
        err = lib.TRITONSERVER_InferenceRequestNew(holder, self._server, self._name(plan.model_name), plan.model_version)
        if err != ffi.NULL:
            problem = self._library.take_error(err)
            raise capi_codec.domain_error(problem.code, problem.message)
        request = holder[0]
        try:
            self._describe(request, plan, call.keep)
            handle = call.handle
            self._ok(lib.TRITONSERVER_InferenceRequestSetReleaseCallback(request, self._hooks.release_request, handle))
            self._ok(lib.TRITONSERVER_InferenceRequestSetResponseCallback(request, self._allocator, handle, self._hooks.response, handle))
            call.request = request
            self._live.add(call)
            err = lib.TRITONSERVER_ServerInferAsync(self._server, request, ffi.NULL)
            if err != ffi.NULL:
                self._live.discard(call)
                call.request = None
                self._ok(err)
        except BaseException:
            lib.TRITONSERVER_InferenceRequestDelete(request)  # Triton did not take it: ours to delete
            call.keep = []
            raise

    def _ok(self, err) -> None:
        if err != ffi.NULL:
            problem = self._library.take_error(err)
            raise capi_codec.domain_error(problem.code, problem.message)

    def _describe(self, request, plan: RequestPlan, keep: list) -> None:
        lib, ok = self._lib, self._ok
        if plan.id:
            ok(lib.TRITONSERVER_InferenceRequestSetId(request, plan.id.encode()))
        if plan.flags:
            ok(lib.TRITONSERVER_InferenceRequestSetFlags(request, plan.flags))
        if plan.correlation_id is not None:
            if isinstance(plan.correlation_id, str):
                ok(lib.TRITONSERVER_InferenceRequestSetCorrelationIdString(request, plan.correlation_id.encode()))
            else:
                ok(lib.TRITONSERVER_InferenceRequestSetCorrelationId(request, plan.correlation_id & ((1 << 64) - 1)))
        if plan.priority is not None:
            ok(lib.TRITONSERVER_InferenceRequestSetPriorityUInt64(request, plan.priority))
        if plan.timeout_us is not None:
            ok(lib.TRITONSERVER_InferenceRequestSetTimeoutMicroseconds(request, max(plan.timeout_us, 0)))
        for key, value in plan.parameters:
            k = key.encode()
            if isinstance(value, bool):
                ok(lib.TRITONSERVER_InferenceRequestSetBoolParameter(request, k, value))
            elif isinstance(value, int):
                ok(lib.TRITONSERVER_InferenceRequestSetIntParameter(request, k, value))
            elif isinstance(value, float):
                ok(lib.TRITONSERVER_InferenceRequestSetDoubleParameter(request, k, value))
            else:
                ok(lib.TRITONSERVER_InferenceRequestSetStringParameter(request, k, value.encode()))
        for tensor in plan.inputs:
            name = self._name(tensor.name)
            shape = tensor.shape
            ok(lib.TRITONSERVER_InferenceRequestAddInput(request, name, _DTYPE.get(tensor.datatype, 0), shape, len(shape)))
            for chunk in tensor.chunks:
                pointer = ffi.from_buffer(chunk)  # keeps ``chunk`` alive as long as ``pointer`` lives
                keep.append(pointer)
                ok(lib.TRITONSERVER_InferenceRequestAppendInputData(request, name, pointer, len(pointer), CPU, 0))
        for output in plan.outputs:
            ok(lib.TRITONSERVER_InferenceRequestAddRequestedOutput(request, self._name(output)))

    # ---- completion (event loop) --------------------------------------------------------------

    def _on_response(self, call: _Call, response, flags: int) -> None:
        final = bool(flags & _FINAL)
        result = None
        if response != ffi.NULL:
            try:
                result = self._read(call, response)
            except capi.TritonError as err:
                result = err
            finally:
                self._lib.TRITONSERVER_InferenceResponseDelete(response)
        if final:
            call.final = True
            if call.timer is not None:
                call.timer.cancel()
        if call.stream is not None:
            call.stream._deliver(call, result, final)
        else:
            self._deliver_unary(call, result, final)
        if final and call.released:
            self._retire(call)
        if self._released:
            self._sweep()

    def _deliver_unary(self, call: _Call, result, final: bool) -> None:
        future = call.future
        if future.done():
            return
        if isinstance(result, capi.TritonError):
            future.set_exception(self._failure(call.plan.model_name, result))
        elif result is not None:
            future.set_result(result)
        elif final:
            future.set_exception(BackendError(f"model '{call.plan.model_name}' sent no response"))

    def _read(self, call: _Call, response) -> InferResult:
        lib, check = self._lib, self._library.check
        err = lib.TRITONSERVER_InferenceResponseError(response)
        if err != ffi.NULL:
            raise self._library.peek_error(err)  # owned by the response
        name_p, version_p, count_p = self._name_p, self._version_p, self._count_p
        check(lib.TRITONSERVER_InferenceResponseModel(response, name_p, version_p))
        model_name, model_version = ffi.string(name_p[0]).decode(), str(version_p[0])
        check(lib.TRITONSERVER_InferenceResponseId(response, name_p))
        request_id = ffi.string(name_p[0]).decode() if name_p[0] != ffi.NULL else ""
        parameters = {}
        check(lib.TRITONSERVER_InferenceResponseParameterCount(response, count_p))
        for i in range(count_p[0]):
            check(lib.TRITONSERVER_InferenceResponseParameter(response, i, name_p, self._ptype_p, self._pvalue_p))
            parameters[ffi.string(name_p[0]).decode()] = _parameter_value(self._ptype_p[0], self._pvalue_p[0])
        check(lib.TRITONSERVER_InferenceResponseOutputCount(response, count_p))
        outputs = []
        out, ptrs, buffers = self._out, self._out_ptrs, call.buffers
        for i in range(count_p[0]):
            check(lib.TRITONSERVER_InferenceResponseOutput(response, i, *ptrs))
            size = out.byte_size
            index = int(ffi.cast("uintptr_t", out.userp))
            storage = buffers.pop(index, None) if index else None
            if storage is None:  # not a buffer this allocator gave (never expected): copy it
                data = ffi.unpack(ffi.cast("char*", out.base), size) if size else b""
            elif size == len(storage):
                data = storage
            else:
                data = memoryview(storage)[:size]
            outputs.append(Output(ffi.string(out.name).decode(), _DTYPE_NAME.get(out.datatype, "INVALID"), ffi.unpack(out.shape, out.dim_count), data))
        return InferResult(model_name, model_version, request_id, parameters, outputs)

    def _sweep(self) -> None:
        """Delete the requests Triton gave back (their inputs are free to go)."""
        lib = self._lib
        self._sweep_posted = False  # before draining: a release from now on posts another sweep
        released = self._released
        while released:
            call = released.popleft()
            if call.request is not None:
                lib.TRITONSERVER_InferenceRequestDelete(call.request)
                call.request = None
            call.keep = []
            if call.final:
                self._retire(call)

    def _retire(self, call: _Call) -> None:
        if call.request is None:
            self._live.discard(call)

    def _expire(self, call: _Call) -> None:
        call.timer = None
        if call.future is not None and not call.future.done():
            call.future.set_exception(DeadlineExceeded(f"model '{call.plan.model_name}' did not answer in time"))
        self._cancel(call)

    def _cancel(self, call: _Call) -> None:
        """Ask Triton to drop a request still in flight (best effort; its callbacks still come)."""
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if not call.final and not call.released and call.request is not None:
            self._library.take_error(self._lib.TRITONSERVER_InferenceRequestCancel(call.request))

    def _fail(self, call: _Call, err: InferplaneError) -> None:
        if call.future is not None and not call.future.done():
            call.future.set_exception(err)
        if call.stream is not None:
            call.stream._abort(err)

    # ---- a model whose stub died --------------------------------------------------------------

    def _failure(self, model: str, err: capi.TritonError) -> InferplaneError:
        """The domain error for a failed response; a dead stub starts the model's reload."""
        if self.heal_stubs and capi_codec.is_stub_death(err.code, err.message):
            self._heal(model)
            return BackendUnavailable(f"model '{model}' is restarting (its Python stub process died): {err.message}", retry_after_s=1.0)
        return capi_codec.domain_error(err.code, err.message)

    def _refuse_if_healing(self, model: str) -> None:
        if model in self._healing:
            raise BackendUnavailable(f"model '{model}' is restarting (its Python stub process died)", retry_after_s=1.0)

    def _heal(self, model: str) -> None:
        if model in self._healing or self._stopped:
            return
        self._healing[model] = asyncio.create_task(self._reload(model), name=f"reload-{model}")

    async def _reload(self, model: str) -> None:
        try:
            since = time.monotonic() - self._last_heal.get(model, 0.0)
            if since < 1.0:
                await asyncio.sleep(1.0 - since)  # a model that keeps dying is retried at most once a second
            self._last_heal[model] = time.monotonic()
            log.warning("model '%s': its Python stub died; reloading it", model)
            # a load of a model already loaded from unchanged files is a no-op: unload it first
            await self.unload_model(model)
            try:
                await self.wait_unloaded(model, timeout=UNLOAD_WAIT_S)
            except DeadlineExceeded:
                # Triton 2.51: once a request has failed on the dead stub, the model never finishes
                # unloading (the remote tritonserver does the same); a new instance loads beside it
                log.warning("model '%s': the dead stub's instance does not unload; loading a new one beside it", model)
                self.leaked_instances += 1
            await self.load_model(model)
            self.stub_restarts += 1
            log.warning("model '%s' reloaded after its stub died", model)
        except InferplaneError as err:
            log.error("reloading model '%s' after its stub died failed: %s", model, err)
        finally:
            self._healing.pop(model, None)

    # ---- streams ------------------------------------------------------------------------------

    def stream_raw(self, timeout: float | None = None, metadata: tuple | None = None, *, model: str = "", affinity: str | None = None) -> "InProcessStream":
        """A ModelStreamInfer call on bytes, like ``TritonClient.stream_raw``: ``await write(raw)``,
        ``await done_writing()``, ``async for response in stream``, ``cancel()`` (``affinity``: unused, one Triton)."""
        return InProcessStream(self, timeout)
