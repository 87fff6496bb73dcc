"""Bindings to Triton's in-process C API (``libtritonserver``) with cffi in ABI mode.

The declarations below are written from Triton's documented ``tritonserver.h`` (API 1.34, Triton
2.51, the library the ``nvidia-pytriton`` wheel ships as ``nvidia_pytriton.libs/libtritonserver-*.so``).
Only the calls the frontend uses are declared. Enums are passed as ``int`` (their C size).

What must be true before and after ``dlopen``:

* Before: its dependencies must be loadable. ``libtritonserver`` carries ``RUNPATH $ORIGIN``,
  which finds its direct dependencies next to it, but ``RUNPATH`` does not apply to *their*
  dependencies (libcurl needs libnghttp2, libssh, ... and has no RPATH of its own), and setting
  ``LD_LIBRARY_PATH`` now is too late (the loader reads it once, at process start). So
  :func:`load_library` first opens, by absolute path and dependencies first, every library of
  ``nvidia_pytriton.libs`` that ``libtritonserver`` needs (read from the ELF ``DT_NEEDED``
  entries); the loader then matches each later ``NEEDED`` by soname to the object already loaded.
* Before the Python backend loads: ``libtriton_python.so`` lives in the backend directory the
  supervisor builds (``workdir/backends/python``, a symlink to the wheel's file). Its ``RPATH``
  is ``$ORIGIN/../../../../nvidia_pytriton.libs``, and ``$ORIGIN`` is the *symlink's* folder, so
  its ``libarchive`` is not found from there. The same preloading covers it (its closure is
  loaded first, then the library by its real path; Triton's later ``dlopen`` of the symlink
  resolves to the object already loaded, same file).
* Only for the stub children: the Python backend starts each model's stub through
  ``bash -c "exec triton_python_backend_stub ..."`` with this process's environment, so ``PATH``
  (this interpreter's ``bin`` first: the stub's embedded Python finds its prefix, and the venv's
  packages, through the ``python3`` on PATH) and ``LD_LIBRARY_PATH`` (``LIBDIR`` for libpython,
  ``nvidia_pytriton.libs`` for libcudart: the copied stub's RPATH does not resolve either) must
  be in ``os.environ`` before a model loads. :func:`prepare_process_environment` sets them
  (``os.environ`` writes go through ``putenv``, which the C ``environ`` the backend forks with sees).

cffi releases the GIL around every C call. That is right for the blocking calls (server new,
load, unload, stop) and for the calls that take locks Triton's threads may hold while they wait
for the GIL in one of our callbacks (``ServerInferAsync``: keeping the GIL there could deadlock);
elsewhere each call may hand the GIL to a waiting Triton thread and wait to get it back.
``server.runtime.inprocess`` keeps its callbacks, which run on Triton's threads, free of C calls.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import struct
import sys
import threading
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from cffi import FFI

from server.runtime.triton_install import TritonInstallation, TritonNotInstalled

API_MAJOR, API_MINOR = 1, 34  # what these declarations were written against (Triton 2.51)

_CDEF = r"""
typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Message TRITONSERVER_Message;
typedef struct TRITONSERVER_Metrics TRITONSERVER_Metrics;
typedef struct TRITONSERVER_Parameter TRITONSERVER_Parameter;
typedef struct TRITONSERVER_ResponseAllocator TRITONSERVER_ResponseAllocator;
typedef struct TRITONSERVER_ServerOptions TRITONSERVER_ServerOptions;
typedef struct TRITONSERVER_Server TRITONSERVER_Server;
typedef struct TRITONSERVER_InferenceRequest TRITONSERVER_InferenceRequest;
typedef struct TRITONSERVER_InferenceResponse TRITONSERVER_InferenceResponse;
typedef struct TRITONSERVER_InferenceTrace TRITONSERVER_InferenceTrace;

/* version and errors */
TRITONSERVER_Error* TRITONSERVER_ApiVersion(uint32_t* major, uint32_t* minor);
TRITONSERVER_Error* TRITONSERVER_ErrorNew(int code, const char* msg);
void TRITONSERVER_ErrorDelete(TRITONSERVER_Error* error);
int TRITONSERVER_ErrorCode(TRITONSERVER_Error* error);
const char* TRITONSERVER_ErrorCodeString(TRITONSERVER_Error* error);
const char* TRITONSERVER_ErrorMessage(TRITONSERVER_Error* error);

/* data types */
const char* TRITONSERVER_DataTypeString(int datatype);
int TRITONSERVER_StringToDataType(const char* dtype);
uint32_t TRITONSERVER_DataTypeByteSize(int datatype);

/* parameters (model load) */
TRITONSERVER_Parameter* TRITONSERVER_ParameterNew(const char* name, int type, const void* value);
TRITONSERVER_Parameter* TRITONSERVER_ParameterBytesNew(const char* name, const void* byte_ptr, uint64_t size);
void TRITONSERVER_ParameterDelete(TRITONSERVER_Parameter* parameter);

/* response allocator */
typedef TRITONSERVER_Error* (*TRITONSERVER_ResponseAllocatorAllocFn_t)(
    TRITONSERVER_ResponseAllocator* allocator, const char* tensor_name, size_t byte_size,
    int memory_type, int64_t memory_type_id, void* userp, void** buffer, void** buffer_userp,
    int* actual_memory_type, int64_t* actual_memory_type_id);
typedef TRITONSERVER_Error* (*TRITONSERVER_ResponseAllocatorReleaseFn_t)(
    TRITONSERVER_ResponseAllocator* allocator, void* buffer, void* buffer_userp, size_t byte_size,
    int memory_type, int64_t memory_type_id);
typedef TRITONSERVER_Error* (*TRITONSERVER_ResponseAllocatorStartFn_t)(
    TRITONSERVER_ResponseAllocator* allocator, void* userp);
TRITONSERVER_Error* TRITONSERVER_ResponseAllocatorNew(
    TRITONSERVER_ResponseAllocator** allocator, TRITONSERVER_ResponseAllocatorAllocFn_t alloc_fn,
    TRITONSERVER_ResponseAllocatorReleaseFn_t release_fn, TRITONSERVER_ResponseAllocatorStartFn_t start_fn);
TRITONSERVER_Error* TRITONSERVER_ResponseAllocatorDelete(TRITONSERVER_ResponseAllocator* allocator);

/* messages (JSON) and metrics */
TRITONSERVER_Error* TRITONSERVER_MessageNewFromSerializedJson(TRITONSERVER_Message** message, const char* base, size_t byte_size);
TRITONSERVER_Error* TRITONSERVER_MessageDelete(TRITONSERVER_Message* message);
TRITONSERVER_Error* TRITONSERVER_MessageSerializeToJson(TRITONSERVER_Message* message, const char** base, size_t* byte_size);
TRITONSERVER_Error* TRITONSERVER_MetricsDelete(TRITONSERVER_Metrics* metrics);
TRITONSERVER_Error* TRITONSERVER_MetricsFormatted(TRITONSERVER_Metrics* metrics, int format, const char** base, size_t* byte_size);

/* server options */
TRITONSERVER_Error* TRITONSERVER_ServerOptionsNew(TRITONSERVER_ServerOptions** options);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsDelete(TRITONSERVER_ServerOptions* options);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetServerId(TRITONSERVER_ServerOptions* options, const char* server_id);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetModelRepositoryPath(TRITONSERVER_ServerOptions* options, const char* path);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetModelControlMode(TRITONSERVER_ServerOptions* options, int mode);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetStartupModel(TRITONSERVER_ServerOptions* options, const char* model_name);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetStrictModelConfig(TRITONSERVER_ServerOptions* options, bool strict);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetStrictReadiness(TRITONSERVER_ServerOptions* options, bool strict);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetExitOnError(TRITONSERVER_ServerOptions* options, bool exit);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetExitTimeout(TRITONSERVER_ServerOptions* options, unsigned int timeout);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetPinnedMemoryPoolByteSize(TRITONSERVER_ServerOptions* options, uint64_t size);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetCudaMemoryPoolByteSize(TRITONSERVER_ServerOptions* options, int gpu_device, uint64_t size);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetMinSupportedComputeCapability(TRITONSERVER_ServerOptions* options, double cc);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetCacheConfig(TRITONSERVER_ServerOptions* options, const char* cache_name, const char* config_json);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetCacheDirectory(TRITONSERVER_ServerOptions* options, const char* cache_dir);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetBackendDirectory(TRITONSERVER_ServerOptions* options, const char* backend_dir);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetRepoAgentDirectory(TRITONSERVER_ServerOptions* options, const char* repoagent_dir);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetBackendConfig(TRITONSERVER_ServerOptions* options, const char* backend_name, const char* setting, const char* value);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetModelLoadThreadCount(TRITONSERVER_ServerOptions* options, unsigned int thread_count);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetLogFile(TRITONSERVER_ServerOptions* options, const char* file);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetLogInfo(TRITONSERVER_ServerOptions* options, bool log);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetLogWarn(TRITONSERVER_ServerOptions* options, bool log);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetLogError(TRITONSERVER_ServerOptions* options, bool log);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetLogFormat(TRITONSERVER_ServerOptions* options, int format);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetLogVerbose(TRITONSERVER_ServerOptions* options, int level);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetMetrics(TRITONSERVER_ServerOptions* options, bool metrics);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetGpuMetrics(TRITONSERVER_ServerOptions* options, bool gpu_metrics);
TRITONSERVER_Error* TRITONSERVER_ServerOptionsSetCpuMetrics(TRITONSERVER_ServerOptions* options, bool cpu_metrics);

/* server */
TRITONSERVER_Error* TRITONSERVER_ServerNew(TRITONSERVER_Server** server, TRITONSERVER_ServerOptions* options);
TRITONSERVER_Error* TRITONSERVER_ServerDelete(TRITONSERVER_Server* server);
TRITONSERVER_Error* TRITONSERVER_ServerStop(TRITONSERVER_Server* server);
TRITONSERVER_Error* TRITONSERVER_ServerSetExitTimeout(TRITONSERVER_Server* server, unsigned int timeout);
TRITONSERVER_Error* TRITONSERVER_ServerIsLive(TRITONSERVER_Server* server, bool* live);
TRITONSERVER_Error* TRITONSERVER_ServerIsReady(TRITONSERVER_Server* server, bool* ready);
TRITONSERVER_Error* TRITONSERVER_ServerModelIsReady(TRITONSERVER_Server* server, const char* model_name, int64_t model_version, bool* ready);
TRITONSERVER_Error* TRITONSERVER_ServerModelTransactionProperties(TRITONSERVER_Server* server, const char* model_name, int64_t model_version, uint32_t* txn_flags, void** voidp);
TRITONSERVER_Error* TRITONSERVER_ServerMetadata(TRITONSERVER_Server* server, TRITONSERVER_Message** server_metadata);
TRITONSERVER_Error* TRITONSERVER_ServerModelMetadata(TRITONSERVER_Server* server, const char* model_name, int64_t model_version, TRITONSERVER_Message** model_metadata);
TRITONSERVER_Error* TRITONSERVER_ServerModelStatistics(TRITONSERVER_Server* server, const char* model_name, int64_t model_version, TRITONSERVER_Message** model_stats);
TRITONSERVER_Error* TRITONSERVER_ServerModelConfig(TRITONSERVER_Server* server, const char* model_name, int64_t model_version, uint32_t config_version, TRITONSERVER_Message** model_config);
TRITONSERVER_Error* TRITONSERVER_ServerModelIndex(TRITONSERVER_Server* server, uint32_t flags, TRITONSERVER_Message** model_index);
TRITONSERVER_Error* TRITONSERVER_ServerLoadModel(TRITONSERVER_Server* server, const char* model_name);
TRITONSERVER_Error* TRITONSERVER_ServerLoadModelWithParameters(TRITONSERVER_Server* server, const char* model_name, const TRITONSERVER_Parameter** parameters, uint64_t parameter_count);
TRITONSERVER_Error* TRITONSERVER_ServerUnloadModel(TRITONSERVER_Server* server, const char* model_name);
TRITONSERVER_Error* TRITONSERVER_ServerUnloadModelAndDependents(TRITONSERVER_Server* server, const char* model_name);
TRITONSERVER_Error* TRITONSERVER_ServerMetrics(TRITONSERVER_Server* server, TRITONSERVER_Metrics** metrics);
TRITONSERVER_Error* TRITONSERVER_ServerInferAsync(TRITONSERVER_Server* server, TRITONSERVER_InferenceRequest* inference_request, TRITONSERVER_InferenceTrace* trace);

/* inference request */
typedef void (*TRITONSERVER_InferenceRequestReleaseFn_t)(TRITONSERVER_InferenceRequest* request, uint32_t flags, void* userp);
typedef void (*TRITONSERVER_InferenceResponseCompleteFn_t)(TRITONSERVER_InferenceResponse* response, uint32_t flags, void* userp);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestNew(TRITONSERVER_InferenceRequest** inference_request, TRITONSERVER_Server* server, const char* model_name, int64_t model_version);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestDelete(TRITONSERVER_InferenceRequest* inference_request);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetId(TRITONSERVER_InferenceRequest* inference_request, const char* id);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetFlags(TRITONSERVER_InferenceRequest* inference_request, uint32_t flags);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetCorrelationId(TRITONSERVER_InferenceRequest* inference_request, uint64_t correlation_id);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetCorrelationIdString(TRITONSERVER_InferenceRequest* inference_request, const char* correlation_id);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetPriorityUInt64(TRITONSERVER_InferenceRequest* inference_request, uint64_t priority);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetTimeoutMicroseconds(TRITONSERVER_InferenceRequest* inference_request, uint64_t timeout_us);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestCancel(TRITONSERVER_InferenceRequest* inference_request);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestAddInput(TRITONSERVER_InferenceRequest* inference_request, const char* name, int datatype, const int64_t* shape, uint64_t dim_count);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestAppendInputData(TRITONSERVER_InferenceRequest* inference_request, const char* name, const void* base, size_t byte_size, int memory_type, int64_t memory_type_id);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestAddRequestedOutput(TRITONSERVER_InferenceRequest* inference_request, const char* name);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetReleaseCallback(TRITONSERVER_InferenceRequest* inference_request, TRITONSERVER_InferenceRequestReleaseFn_t request_release_fn, void* request_release_userp);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetResponseCallback(TRITONSERVER_InferenceRequest* inference_request, TRITONSERVER_ResponseAllocator* response_allocator, void* response_allocator_userp, TRITONSERVER_InferenceResponseCompleteFn_t response_fn, void* response_userp);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetStringParameter(TRITONSERVER_InferenceRequest* request, const char* key, const char* value);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetIntParameter(TRITONSERVER_InferenceRequest* request, const char* key, int64_t value);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetBoolParameter(TRITONSERVER_InferenceRequest* request, const char* key, bool value);
TRITONSERVER_Error* TRITONSERVER_InferenceRequestSetDoubleParameter(TRITONSERVER_InferenceRequest* request, const char* key, double value);

/* inference response */
TRITONSERVER_Error* TRITONSERVER_InferenceResponseDelete(TRITONSERVER_InferenceResponse* inference_response);
TRITONSERVER_Error* TRITONSERVER_InferenceResponseError(TRITONSERVER_InferenceResponse* inference_response);
TRITONSERVER_Error* TRITONSERVER_InferenceResponseModel(TRITONSERVER_InferenceResponse* inference_response, const char** model_name, int64_t* model_version);
TRITONSERVER_Error* TRITONSERVER_InferenceResponseId(TRITONSERVER_InferenceResponse* inference_response, const char** request_id);
TRITONSERVER_Error* TRITONSERVER_InferenceResponseParameterCount(TRITONSERVER_InferenceResponse* inference_response, uint32_t* count);
TRITONSERVER_Error* TRITONSERVER_InferenceResponseParameter(TRITONSERVER_InferenceResponse* inference_response, uint32_t index, const char** name, int* type, const void** vvalue);
TRITONSERVER_Error* TRITONSERVER_InferenceResponseOutputCount(TRITONSERVER_InferenceResponse* inference_response, uint32_t* count);
TRITONSERVER_Error* TRITONSERVER_InferenceResponseOutput(TRITONSERVER_InferenceResponse* inference_response, uint32_t index, const char** name, int* datatype, const int64_t** shape, uint64_t* dim_count, const void** base, size_t* byte_size, int* memory_type, int64_t* memory_type_id, void** userp);

/* the out-parameters of one InferenceResponseOutput call, allocated once per response */
typedef struct {
    const char* name; int datatype; const int64_t* shape; uint64_t dim_count; const void* base;
    size_t byte_size; int memory_type; int64_t memory_type_id; void* userp;
} inferplane_output_t;
"""


class ErrorCode(IntEnum):
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class DataType(IntEnum):
    INVALID = 0
    BOOL = 1
    UINT8 = 2
    UINT16 = 3
    UINT32 = 4
    UINT64 = 5
    INT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    FP16 = 10
    FP32 = 11
    FP64 = 12
    BYTES = 13
    BF16 = 14


# the OIP datatype string of each Triton data type ("INVALID" never goes on the wire)
DATATYPE_NAMES = {d: d.name for d in DataType if d is not DataType.INVALID}
DATATYPE_BY_NAME = {name: d for d, name in DATATYPE_NAMES.items()}

MEMORY_CPU = 0
PARAMETER_STRING, PARAMETER_INT, PARAMETER_BOOL, PARAMETER_DOUBLE, PARAMETER_BYTES = range(5)
MODEL_CONTROL_NONE, MODEL_CONTROL_POLL, MODEL_CONTROL_EXPLICIT = range(3)
LOG_DEFAULT, LOG_ISO8601 = range(2)
METRIC_PROMETHEUS = 0
REQUEST_FLAG_SEQUENCE_START, REQUEST_FLAG_SEQUENCE_END = 1, 2
REQUEST_RELEASE_ALL = 1
RESPONSE_COMPLETE_FINAL = 1
INDEX_FLAG_READY = 1
TXN_ONE_TO_ONE, TXN_DECOUPLED = 1, 2


class TritonError(Exception):
    """A ``TRITONSERVER_Error``: its code and message (the C object is already deleted)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.UNKNOWN
        self.message = message

    def __repr__(self) -> str:
        return f"TritonError({self.code.name}, {self.message!r})"


ffi = FFI()
ffi.cdef(_CDEF)


class Library:
    """The loaded ``libtritonserver``: ``lib`` for the calls, plus error helpers."""

    def __init__(self, path: Path, backend_library: Path | None = None):
        self.path = path
        self._preloaded = preload_closure(path, path.parent)
        self.lib = ffi.dlopen(str(path), ffi.RTLD_NOW | ffi.RTLD_GLOBAL)
        if backend_library is not None:  # see the module docstring
            real = Path(os.path.realpath(backend_library))
            self._preloaded += preload_closure(real, path.parent, include_self=True)
        major, minor = ffi.new("uint32_t*"), ffi.new("uint32_t*")
        self.check(self.lib.TRITONSERVER_ApiVersion(major, minor))
        self.api_version = (major[0], minor[0])
        if major[0] != API_MAJOR or minor[0] < API_MINOR:
            raise TritonError(ErrorCode.UNSUPPORTED, f"libtritonserver API {major[0]}.{minor[0]}; these bindings need {API_MAJOR}.{API_MINOR}+")

    def take_error(self, err) -> TritonError | None:
        """The Python error for a returned ``TRITONSERVER_Error*`` (deleting it), or None."""
        if err == ffi.NULL:
            return None
        lib = self.lib
        code = lib.TRITONSERVER_ErrorCode(err)
        message = ffi.string(lib.TRITONSERVER_ErrorMessage(err)).decode("utf-8", "replace")
        lib.TRITONSERVER_ErrorDelete(err)
        return TritonError(code, message)

    def check(self, err) -> None:
        if err != ffi.NULL:
            raise self.take_error(err)

    def peek_error(self, err) -> TritonError | None:
        """Like :meth:`take_error` for an error the caller does not own (a response's)."""
        if err == ffi.NULL:
            return None
        code = self.lib.TRITONSERVER_ErrorCode(err)
        message = ffi.string(self.lib.TRITONSERVER_ErrorMessage(err)).decode("utf-8", "replace")
        return TritonError(code, message)

    def message_json(self, produce) -> bytes:
        """Call ``produce(TRITONSERVER_Message**)`` and return the message's JSON bytes."""
        out = ffi.new("TRITONSERVER_Message**")
        self.check(produce(out))
        try:
            base, size = ffi.new("const char**"), ffi.new("size_t*")
            self.check(self.lib.TRITONSERVER_MessageSerializeToJson(out[0], base, size))
            return ffi.unpack(base[0], size[0])
        finally:
            self.lib.TRITONSERVER_MessageDelete(out[0])


@dataclass(frozen=True)
class ServerOptions:
    """``TRITONSERVER_ServerOptions`` as the supervisor's ``tritonserver`` flags set them: explicit
    model control, strict model config (= ``--disable-auto-complete-config``), strict readiness
    off, exit on error, the Python backend's shm prefix, the ``local`` response cache. The pinned
    memory pool keeps tritonserver's default (256 MiB): with it the normalized model configs
    (``optimization.*_pinned_memory``) are the same as the remote Triton's."""

    repository: Path
    backends: Path
    repoagents: Path
    caches: Path
    response_cache_bytes: int
    python_shm_prefix: str
    exit_timeout_s: int = 5
    log_file: Path | None = None
    log_verbose: int = 0
    metrics: bool = False
    server_id: str = "inferplane"

    def new_server(self, library: Library):
        """``TRITONSERVER_ServerNew`` with these options (blocking: run it off the event loop)."""
        lib, check = library.lib, library.check
        holder = ffi.new("TRITONSERVER_ServerOptions**")
        check(lib.TRITONSERVER_ServerOptionsNew(holder))
        options = holder[0]
        try:
            check(lib.TRITONSERVER_ServerOptionsSetServerId(options, self.server_id.encode()))
            check(lib.TRITONSERVER_ServerOptionsSetModelRepositoryPath(options, str(self.repository).encode()))
            check(lib.TRITONSERVER_ServerOptionsSetModelControlMode(options, MODEL_CONTROL_EXPLICIT))
            check(lib.TRITONSERVER_ServerOptionsSetStrictModelConfig(options, True))
            check(lib.TRITONSERVER_ServerOptionsSetStrictReadiness(options, False))
            check(lib.TRITONSERVER_ServerOptionsSetExitOnError(options, True))
            check(lib.TRITONSERVER_ServerOptionsSetExitTimeout(options, self.exit_timeout_s))
            check(lib.TRITONSERVER_ServerOptionsSetBackendDirectory(options, str(self.backends).encode()))
            check(lib.TRITONSERVER_ServerOptionsSetRepoAgentDirectory(options, str(self.repoagents).encode()))
            check(lib.TRITONSERVER_ServerOptionsSetCacheDirectory(options, str(self.caches).encode()))
            if self.response_cache_bytes:
                config = json.dumps({"size": str(self.response_cache_bytes)}).encode()
                check(lib.TRITONSERVER_ServerOptionsSetCacheConfig(options, b"local", config))
            check(lib.TRITONSERVER_ServerOptionsSetBackendConfig(options, b"python", b"shm-region-prefix-name", self.python_shm_prefix.encode()))
            if self.log_file is not None:
                check(lib.TRITONSERVER_ServerOptionsSetLogFile(options, str(self.log_file).encode()))
            check(lib.TRITONSERVER_ServerOptionsSetLogInfo(options, True))
            check(lib.TRITONSERVER_ServerOptionsSetLogWarn(options, True))
            check(lib.TRITONSERVER_ServerOptionsSetLogError(options, True))
            check(lib.TRITONSERVER_ServerOptionsSetLogVerbose(options, self.log_verbose))
            check(lib.TRITONSERVER_ServerOptionsSetMetrics(options, self.metrics))
            check(lib.TRITONSERVER_ServerOptionsSetGpuMetrics(options, False))
            check(lib.TRITONSERVER_ServerOptionsSetCpuMetrics(options, self.metrics))
            server = ffi.new("TRITONSERVER_Server**")
            check(lib.TRITONSERVER_ServerNew(server, options))
            return server[0]
        finally:
            lib.TRITONSERVER_ServerOptionsDelete(options)


_loaded: Library | None = None
_load_lock = threading.Lock()


def library_path(install: TritonInstallation) -> Path:
    found = sorted(glob.glob(str(install.libs / "libtritonserver*.so")))
    if not found:
        raise TritonNotInstalled(f"no libtritonserver in {install.libs}")
    return Path(found[0])


def load_library(install: TritonInstallation | None = None) -> Library:
    """``libtritonserver`` for this process (loaded once; a library is never unloaded)."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            install = install or TritonInstallation.find()
            _loaded = Library(library_path(install), install.python_backend / "libtriton_python.so")
        return _loaded


def elf_needed(path: Path) -> list[str]:
    """The ``DT_NEEDED`` sonames of a 64-bit little-endian ELF shared object."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for pos in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                needed.append(data[strtab + value : end].decode())
    return needed


def preload_closure(path: Path, libs: Path, *, include_self: bool = False, _seen: set | None = None) -> list:
    """Open (dependencies first) every library of ``libs`` that ``path`` needs, directly or not."""
    seen = set() if _seen is None else _seen
    handles = []
    for name in elf_needed(path):
        dep = libs / name
        if name in seen or not dep.exists():
            continue  # a system library (libc, libstdc++, libz): the loader's default paths find it
        seen.add(name)
        handles += preload_closure(dep, libs, include_self=True, _seen=seen)
    if include_self:
        handles.append(ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL))
    return handles


def prepare_process_environment(install: TritonInstallation) -> dict[str, str | None]:
    """Put what the Python-backend stubs need into this process's environment (they inherit it).

    Returns what it changed, as the previous values (None: was unset), for
    :func:`restore_process_environment`. Call it before any model loads, and before Triton's
    threads start (``putenv`` is not safe against a concurrent ``getenv``).
    """
    wanted = install.environment(dict(os.environ))
    previous: dict[str, str | None] = {}
    for key in ("PATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS"):
        current = os.environ.get(key)
        if key not in wanted or current == wanted[key]:
            continue
        if key == "PATH" and (current or "").split(os.pathsep)[:1] == [str(Path(sys.executable).parent)]:
            continue  # already first
        if key == "LD_LIBRARY_PATH" and _has_all(current or "", wanted[key]):
            continue
        previous[key] = current
        os.environ[key] = wanted[key]
    return previous


def restore_process_environment(previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _has_all(current: str, wanted: str) -> bool:
    have = set(current.split(os.pathsep))
    return all(p in have for p in wanted.split(os.pathsep) if p)
