"""The one in-memory ``server.dataplane.backend.Backend`` for unit tests.

It keeps what a Triton would (which models and versions are loaded, the requests it was sent,
per-model counts for its statistics) and fails as the real clients do: with domain errors.
Knobs: ``fail`` (errors raised by the next calls that send a request: an infer, a stream's
write), ``broken`` (an error every infer and every stream read raises while it is set: an engine
that refuses, a Triton gone), ``hold`` (an event every infer and stream read waits for), ``live`` (what the health probes answer), ``down`` (every call raises
``BackendUnavailable``, as an unreachable Triton's client does), ``answer`` (what an infer
answers; by default a ModelInferResponse naming the request's model and id) and ``stream_answer``
(what a stream answers per request; by default ``answer``'s in a ModelStreamInferResponse).
``tests/integration/test_backend_contract.py`` runs the real backends' contract suite against it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable

from server.dataplane.backend import DOWN, EXITING, LIVE
from server.dataplane.batch_codec import CODEC
from server.dataplane.wire import request_model
from server.errors import BackendUnavailable, ModelNotFound, Unimplemented
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inference import model_config_pb2 as mc


def model_answer(raw: bytes) -> bytes:
    """What Triton answers in shape: the request's model, version and id (no outputs)."""
    request = pb.ModelInferRequest.FromString(raw)
    return pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version or "1", id=request.id).SerializeToString()


def streamed_answer(answer: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    """A stream's answer to one request: ``answer``'s ModelInferResponse in a ModelStreamInferResponse."""
    return lambda raw: pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse.FromString(answer(raw))).SerializeToString()


def _rows(raw: bytes) -> int:
    """A request's batch: its first input's first dimension (1 without inputs)."""
    request = pb.ModelInferRequest.FromString(raw)
    return request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1


class FakeBackend:
    def __init__(
        self,
        target: str = "fake",
        models: Iterable[str] = (),
        *,
        answer: Callable[[bytes], bytes] = model_answer,
        stream_answer: Callable[[bytes], bytes] | None = None,
        instances: int = 1,
    ):
        self.target = target
        self.loaded: dict[str, set[int]] = {m: {1} for m in models}
        self.answer = answer
        self.stream_answer = stream_answer or streamed_answer(answer)
        self.instances = instances  # instance_group count in every model's config
        self.requests: list[bytes] = []  # every infer's request, in order
        self.streamed: list[bytes] = []  # every request written on a stream
        self.configs: list[dict] = []  # the config overrides loads carried (parsed JSON)
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.kv: list[float] = []  # KV utilisations streams reported
        self.counts: dict[str, tuple[int, int]] = {}  # model -> (inferences: rows, executions: requests), as Triton counts
        self.calls = 0  # infers attempted (failed ones too)
        self.affinities: list[str | None] = []  # each stream's affinity, in order
        self.fail: list[Exception] = []
        self.broken: Exception | None = None
        self.hold: asyncio.Event | None = None
        self.live = True
        self.down = False
        self.exiting = False  # got SIGTERM: liveness() answers EXITING
        self.closed = False

    @property
    def infers(self) -> list[pb.ModelInferRequest]:
        return [pb.ModelInferRequest.FromString(raw) for raw in self.requests]

    @property
    def stream_requests(self) -> list[pb.ModelInferRequest]:
        return [pb.ModelInferRequest.FromString(raw) for raw in self.streamed]

    def _reachable(self) -> None:
        if self.down:
            raise BackendUnavailable(f"{self.target}: failed to connect to all addresses; connection refused", retry_after_s=1.0)

    def _known(self, name: str) -> None:
        if name not in self.loaded:
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")

    def connect(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True

    # ---- inference ----------------------------------------------------------------------------

    async def infer_raw(self, request: bytes, timeout: float | None = None, *, model: str = "") -> bytes:
        self.calls += 1
        self._reachable()
        if self.fail:
            raise self.fail.pop(0)
        if self.broken is not None:
            raise self.broken
        if self.hold is not None:
            await self.hold.wait()
        model = model or request_model(request)
        self._known(model)
        self.requests.append(request)
        inferences, executions = self.counts.get(model, (0, 0))
        self.counts[model] = (inferences + _rows(request), executions + 1)
        return self.answer(request)

    def batch_codec(self):
        return CODEC

    async def send_batch(self, payload, timeout: float | None, request: pb.ModelInferRequest | None = None):
        return await self.infer_raw(payload, timeout, model=request.model_name if request is not None else "")

    def stream_raw(self, timeout: float | None = None, metadata: tuple | None = None, *, model: str = "", affinity: str | None = None) -> FakeStream:
        self.affinities.append(affinity)
        return FakeStream(self)

    async def unary_raw(self, method: str, request: bytes, timeout: float | None = 30.0) -> bytes:
        self._reachable()
        if method == "ModelStatistics":
            ask = pb.ModelStatisticsRequest.FromString(request)
            return (await self.model_statistics(ask.name, ask.version)).SerializeToString()
        if method == "ModelMetadata":
            ask = pb.ModelMetadataRequest.FromString(request)
            return (await self.model_metadata(ask.name, ask.version)).SerializeToString()
        if method == "ModelConfig":
            ask = pb.ModelConfigRequest.FromString(request)
            return pb.ModelConfigResponse(config=await self.model_config(ask.name, ask.version)).SerializeToString()
        if method == "ModelReady":
            return pb.ModelReadyResponse(ready=pb.ModelReadyRequest.FromString(request).name in self.loaded).SerializeToString()
        if method == "ServerLive":
            return pb.ServerLiveResponse(live=self.live).SerializeToString()
        if method == "RepositoryIndex":
            ask = pb.RepositoryIndexRequest.FromString(request)
            return pb.RepositoryIndexResponse(models=await self.repository_index(ask.ready)).SerializeToString()
        raise Unimplemented(f"method '{method}' is not offered by {self.target}")

    # ---- models -------------------------------------------------------------------------------

    async def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        self._reachable()
        self._known(name)
        config = mc.ModelConfig(name=name, max_batch_size=8)
        config.instance_group.add(count=self.instances, kind=mc.ModelInstanceGroup.KIND_CPU)
        return config

    async def model_metadata(self, name: str, version: str = "") -> pb.ModelMetadataResponse:
        self._reachable()
        self._known(name)
        return pb.ModelMetadataResponse(name=name, versions=[str(v) for v in sorted(self.loaded[name])], platform="fake")

    async def model_statistics(self, name: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        self._reachable()
        if name:
            self._known(name)
        stats = pb.ModelStatisticsResponse()
        for model in sorted(self.loaded):
            if name and model != name:
                continue
            inferences, executions = self.counts.get(model, (0, 0))
            s = stats.model_stats.add(name=model, version=str(max(self.loaded[model])), inference_count=inferences, execution_count=executions)
            s.inference_stats.success.count = executions
            s.inference_stats.queue.ns = 1000 * executions
        return stats

    async def repository_index(self, ready_only: bool = False) -> list:
        self._reachable()
        return [pb.RepositoryIndexResponse.ModelIndex(name=m, version=str(v), state="READY") for m in sorted(self.loaded) for v in sorted(self.loaded[m])]

    async def load_model(self, name: str, timeout: float = 300.0, *, config: str | None = None) -> None:
        self._reachable()
        versions = {1}
        if config is not None:
            doc = json.loads(config)
            self.configs.append(doc)
            versions = {int(v) for v in doc.get("versionPolicy", {}).get("specific", {}).get("versions", [1])}
        self.loads.append(name)
        self.loaded[name] = versions

    async def unload_model(self, name: str, timeout: float = 60.0) -> None:
        self._reachable()
        self.unloads.append(name)
        self.loaded.pop(name, None)

    # ---- health -------------------------------------------------------------------------------

    async def server_live(self, timeout: float = 1.0) -> bool:
        return self.live and not self.down

    async def liveness(self, timeout: float = 1.0) -> str:
        return (EXITING if self.exiting else LIVE) if await self.server_live(timeout) else DOWN

    async def server_ready(self, timeout: float = 1.0) -> bool:
        return self.live and not self.down


class FakeStream:
    """A ModelStreamInfer call on the fake: one answer per request written, after ``done_writing``."""

    def __init__(self, owner: FakeBackend):
        self.owner = owner
        self.written: list[bytes] = []

    async def write(self, raw: bytes) -> None:
        self.owner._reachable()
        if self.owner.fail:
            raise self.owner.fail.pop(0)
        self.written.append(raw)
        self.owner.streamed.append(raw)

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        return True

    def report_kv(self, utilisation: float) -> None:
        self.owner.kv.append(utilisation)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.owner.broken is not None:
            raise self.owner.broken
        if self.owner.hold is not None:
            await self.owner.hold.wait()
        for raw in self.written:
            yield self.owner.stream_answer(raw)
