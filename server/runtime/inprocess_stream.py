"""``InProcessStream``: one ModelStreamInfer call against the in-process Triton."""

from __future__ import annotations

import asyncio
import collections

from google.protobuf.message import DecodeError

from server.errors import Cancelled, DeadlineExceeded, InferplaneError
from server.protogen.inference import grpc_service_pb2 as pb
from server.runtime import capi, capi_codec
from server.runtime.inprocess_call import FINAL_PARAMETER, CallOwner, _Call


class InProcessStream:
    """One ModelStreamInfer call against the in-process Triton (the shape of a grpc.aio stream
    call on bytes). Responses come in completion order; every one carries ``triton_final_response``
    like Triton's gRPC frontend sets it; a request Triton refuses gets an in-stream error."""

    def __init__(self, owner: CallOwner, timeout: float | None):
        self.owner = owner
        self._loop = owner._loop
        self._queue: collections.deque[bytes] = collections.deque()
        self._pending: set[_Call] = set()
        self._waiter: asyncio.Future | None = None
        self._done_writing = False
        self._closed = False
        self._error: BaseException | None = None
        self._deadline = self._loop.call_later(timeout, self._expire) if timeout is not None else None

    async def write(self, raw: bytes) -> None:
        if self._closed or self._done_writing:
            raise Cancelled("the stream is closed for writing")
        try:
            request = pb.ModelInferRequest.FromString(raw)
        except DecodeError as err:
            self._push(pb.ModelStreamInferResponse(error_message=f"malformed ModelInferRequest: {err}"))
            return
        try:
            plan = capi_codec.request_plan(request)
            self.owner._refuse_if_healing(plan.model_name)
            call = _Call(self.owner, plan)
            call.stream = self
            self.owner._submit(call)
        except InferplaneError as err:
            answer = pb.ModelStreamInferResponse(error_message=err.message)
            answer.infer_response.id = request.id
            self._push(answer)
            return
        self._pending.add(call)

    async def done_writing(self) -> None:
        self._done_writing = True
        self._wake()

    def cancel(self) -> bool:
        if self._closed:
            return False
        self._closed = True
        for call in list(self._pending):
            self.owner._cancel(call)
        self._pending.clear()
        if self._deadline is not None:
            self._deadline.cancel()
        self._wake()
        return True

    def report_kv(self, utilisation: float) -> None:
        """One Triton: no member to score (``server.dataplane.backend.BackendStream``)."""

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._queue:
                return self._queue.popleft()
            if self._error is not None:
                err, self._error = self._error, None
                self._closed = True
                raise err
            if self._closed or (self._done_writing and not self._pending):
                if self._deadline is not None:
                    self._deadline.cancel()
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    # -- from the owner, on the loop

    def _deliver(self, call: _Call, result, final: bool) -> None:
        if final:
            self._pending.discard(call)
        if self._closed:
            return
        plan = call.plan
        if isinstance(result, capi.TritonError):
            err = self.owner._failure(plan.model_name, result)
            answer = pb.ModelStreamInferResponse(error_message=err.message)
            answer.infer_response.id, answer.infer_response.model_name = plan.id, plan.model_name
            answer.infer_response.model_version = "" if plan.model_version < 0 else str(plan.model_version)
        elif result is not None:
            answer = pb.ModelStreamInferResponse(infer_response=result.to_message())
        elif final and plan.empty_final_response:
            answer = pb.ModelStreamInferResponse()
            answer.infer_response.id, answer.infer_response.model_name = plan.id, plan.model_name
            answer.infer_response.model_version = "" if plan.model_version < 0 else str(plan.model_version)
        else:
            self._wake()  # a bare final flag the caller did not ask to see
            return
        answer.infer_response.parameters[FINAL_PARAMETER].bool_param = final
        self._push(answer)

    def _push(self, answer: pb.ModelStreamInferResponse) -> None:
        self._queue.append(answer.SerializeToString())
        self._wake()

    def _abort(self, err: InferplaneError) -> None:
        self._pending.clear()
        if not self._closed:
            self._error = err
        self._wake()

    def _expire(self) -> None:
        self._deadline = None
        if self._closed:
            return
        for call in list(self._pending):
            self.owner._cancel(call)
        self._pending.clear()
        self._error = DeadlineExceeded("the stream's deadline passed")
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
