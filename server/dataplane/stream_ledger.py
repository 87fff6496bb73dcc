"""The books of one ModelStreamInfer passthrough: each request the frontend wrote to Triton holds
its quota ticket until Triton's last response for it, and is metered once when it ends.

A caller's stream carries many requests; Triton answers each with one response (a non-decoupled
model) or several (a decoupled one). Which response is a request's last: Triton 2.51 sets the
``triton_final_response`` parameter on every streamed response, decoupled or not, whether or not
the caller asked for ``triton_enable_empty_final_response``; without that parameter (an older
Triton) an error or a non-decoupled model's response is final, and an LLM's response is final
when its ``info`` carries a ``finish_reason``. A request the model never finishes (a decoupled
model that ends it with an empty final response the caller did not ask for, a stream that is
cancelled or breaks) ends with the stream: :meth:`StreamLedger.close`.

Responses name their request by ``id`` and ``model_name`` (a request Triton refuses before
running it comes back as an error with its id only), so requests are matched on id, then model.
Requests alike in both (a caller that sends no ids) are interchangeable here — same tenant, same
quota scopes — and are matched oldest first; the metered compute time sums the same whichever
one a response is matched to.

Each request is one call of the admission pipeline (``server.dataplane.pipeline``), entered
before the write and exited here when the request ends: its queue slot and quota ticket are
released with the tokens the LLM engine last reported (``prompt_tokens + completion_tokens`` from
``info``; 0 for other models) — so concurrency caps count streamed requests in flight and token
quotas are charged, possibly into debt, before the caller sees the final response — and one
usage row is recorded: the model, the version that answered, those tokens, and the time from the
write to Triton to the end. Like ``generate``, every request Triton worked on is metered however
it ended (answer, error, the caller gone).

Triton's own in-stream errors carry no status; the ledger prefixes them with the code they mean
(``INVALID_ARGUMENT: …`` for the LLM engine's caller mistakes, ``INTERNAL: …`` otherwise), the
way the frontend's own in-stream errors read.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from server.dataplane import codecs
from server.dataplane.backend_errors import stream_error
from server.dataplane.pipeline import AdmittedCall, Pipeline
from server.dataplane.signature import is_llm
from server.errors import BackendError, Cancelled
from server.protogen.inference import grpc_service_pb2 as pb

log = logging.getLogger(__name__)

FINAL_PARAMETER = "triton_final_response"
_CODED = re.compile(r"^[A-Z][A-Z_]+: ")


@dataclass(slots=True, eq=False)  # identity: two alike requests are still two
class _Pending:
    model: str
    call: AdmittedCall
    decoupled: bool
    llm: bool
    request_id: str = ""


class StreamLedger:
    """``release``: called once per request as it ends (its place in the process's in-flight bound)."""

    def __init__(self, pipeline: Pipeline, release: Callable[[], None] = lambda: None):
        self.pipeline = pipeline
        self.release = release
        self._pending: dict[str, list[_Pending]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._pending.values())

    def sent(self, request: pb.ModelInferRequest, call: AdmittedCall) -> None:
        """``request`` (admitted as ``call``) is about to be written to Triton (call before the
        write: its first response may arrive before the write returns)."""
        signature = call.signature
        call.computed = True
        call.request = request
        call.dispatched_at = time.perf_counter()
        entry = _Pending(request.model_name, call, signature.decoupled, is_llm(signature), request.id)
        self._pending.setdefault(request.id, []).append(entry)

    async def answered(self, raw: bytes) -> bytes:
        """One response Triton streamed back: close its request's books if it is the last.
        Returns the response to relay (Triton's own errors get their code prefixed)."""
        response = pb.ModelStreamInferResponse.FromString(raw)
        error = None
        if response.error_message and not _CODED.match(response.error_message):
            error = stream_error(response.error_message)
            response.error_message = f"{error.reason}: {response.error_message}"
            raw = response.SerializeToString()
        answer = response.infer_response
        entries = self._pending.get(answer.id)
        if not entries:
            return raw  # not a request this ledger wrote
        entry = next((e for e in entries if e.model == answer.model_name), entries[0]) if answer.model_name else entries[0]
        finish = None
        if entry.llm and answer.outputs:
            finish = self._read_info(entry, answer)
        if FINAL_PARAMETER in answer.parameters:
            final = answer.parameters[FINAL_PARAMETER].bool_param
        else:
            final = bool(response.error_message) or not entry.decoupled or finish is not None
        if not final:
            return raw
        entries.remove(entry)
        if not entries:
            del self._pending[answer.id]
        if answer.model_version:
            entry.call.version = answer.model_version
        if response.error_message and error is None:
            error = BackendError(response.error_message)
        try:
            await self.pipeline.exit(entry.call, error)
        finally:
            self.release()
        return raw

    async def close(self) -> None:
        """The stream ended: every request still open ends here, with what it reported so far."""
        pending, self._pending = self._pending, {}
        for entries in pending.values():
            for entry in entries:
                try:
                    await self.pipeline.exit(entry.call, Cancelled("the stream ended before the request finished"))
                finally:
                    self.release()

    @staticmethod
    def _read_info(entry: _Pending, answer: pb.ModelInferResponse) -> str | None:
        """The engine's token counts from an LLM response's ``info`` into the call; returns its
        finish_reason. A malformed ``info`` counts nothing and never breaks the stream."""
        call = entry.call
        for i, tensor in enumerate(answer.outputs):
            if tensor.name != "info" or i >= len(answer.raw_output_contents):
                continue
            try:
                info = json.loads(codecs.deserialize_bytes(answer.raw_output_contents[i])[0])
                call.tokens_in = int(info.get("prompt_tokens", call.tokens_in))
                call.tokens_out = int(info.get("completion_tokens", call.tokens_out))
                return info.get("finish_reason")
            except (ValueError, IndexError, AttributeError, TypeError):
                log.warning("unreadable info from model %s; its tokens are not counted", entry.model)
                return None
        return None
