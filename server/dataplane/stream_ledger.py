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

When a request ends, its ticket is released with the tokens the LLM engine last reported
(``prompt_tokens + completion_tokens`` from ``info``; 0 for other models) — so concurrency caps
count streamed requests in flight and token quotas are charged, possibly into debt, before the
caller sees the final response — and one usage row is recorded: the model, the version that
answered, those tokens, and the time from the write to Triton to the end. Like ``generate``,
every request Triton worked on is metered however it ended (answer, error, the caller gone).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from server.dataplane import codecs
from server.errors import BackendError, Cancelled
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.quota_policy import QuotaPolicy
from server.dataplane.signature import ModelSignature, is_llm
from server.tenancy.identity import Tenant

log = logging.getLogger(__name__)
FAILED = BackendError("").reason  # the metrics code of a request Triton answered with an error
GONE = Cancelled("").reason  # ... of one still open when the stream ended

FINAL_PARAMETER = "triton_final_response"


@dataclass(slots=True, eq=False)  # identity: two alike requests are still two
class _Pending:
    model: str
    version: str  # what the request asked for, or the model's latest
    ticket: tuple
    decoupled: bool
    llm: bool
    sent: float  # perf_counter at the write to Triton
    request_id: str = ""
    arm: str = ""  # the traffic split's arm that chose the version ("" without a split)
    prompt_tokens: int = 0
    completion_tokens: int = 0


# on_end(model, version, code, seconds, request_id, arm): the request metrics and the traffic split's
# windows (server.dataplane.dataplane passes one)
EndHook = Callable[[str, str, str, float, str, str], None]


class StreamLedger:
    def __init__(self, tenant: Tenant, quotas: QuotaPolicy, meter=None, on_end: EndHook | None = None):  # or a RedisQuotaPolicy
        self.tenant = tenant
        self.quotas = quotas
        self.meter = meter  # server.tenancy.metering.Meter, or None
        self.on_end = on_end
        self._pending: dict[str, list[_Pending]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._pending.values())

    def sent(self, request: pb.ModelInferRequest, signature: ModelSignature, ticket: tuple, arm: str = "") -> None:
        """``request`` is about to be written to Triton, holding ``ticket`` (call before the
        write: its first response may arrive before the write returns)."""
        entry = _Pending(
            request.model_name, request.model_version or signature.latest_version, ticket,
            signature.decoupled, is_llm(signature), time.perf_counter(), request.id, arm,
        )  # fmt: skip
        self._pending.setdefault(request.id, []).append(entry)

    async def answered(self, raw: bytes) -> None:
        """One response Triton streamed back: close its request's books if it is the last."""
        response = pb.ModelStreamInferResponse.FromString(raw)
        answer = response.infer_response
        entries = self._pending.get(answer.id)
        if not entries:
            return  # not a request this ledger wrote
        entry = next((e for e in entries if e.model == answer.model_name), entries[0]) if answer.model_name else entries[0]
        finish = None
        if entry.llm and answer.outputs:
            finish = self._read_info(entry, answer)
        if FINAL_PARAMETER in answer.parameters:
            final = answer.parameters[FINAL_PARAMETER].bool_param
        else:
            final = bool(response.error_message) or not entry.decoupled or finish is not None
        if not final:
            return
        entries.remove(entry)
        if not entries:
            del self._pending[answer.id]
        code = FAILED if response.error_message else "OK"
        await self._close(entry, answer.model_version or entry.version, code)

    async def close(self) -> None:
        """The stream ended: every request still open ends here, with what it reported so far."""
        pending, self._pending = self._pending, {}
        for entries in pending.values():
            for entry in entries:
                await self._close(entry, entry.version, GONE)

    async def _close(self, entry: _Pending, version: str, code: str) -> None:
        seconds = time.perf_counter() - entry.sent
        if self.on_end is not None:
            self.on_end(entry.model, version, code, seconds, entry.request_id, entry.arm)
        compute_us = int(seconds * 1e6)
        await self.quotas.release(entry.ticket, entry.prompt_tokens + entry.completion_tokens)
        if self.meter is not None:
            self.meter.record(
                self.tenant.name, self.tenant.team, entry.model, version,
                input_tokens=entry.prompt_tokens, output_tokens=entry.completion_tokens, compute_us=compute_us,
            )  # fmt: skip

    @staticmethod
    def _read_info(entry: _Pending, answer: pb.ModelInferResponse) -> str | None:
        """The engine's token counts from an LLM response's ``info`` into ``entry``; returns its
        finish_reason. A malformed ``info`` counts nothing and never breaks the stream."""
        for i, tensor in enumerate(answer.outputs):
            if tensor.name != "info" or i >= len(answer.raw_output_contents):
                continue
            try:
                info = json.loads(codecs.deserialize_bytes(answer.raw_output_contents[i])[0])
                entry.prompt_tokens = int(info.get("prompt_tokens", entry.prompt_tokens))
                entry.completion_tokens = int(info.get("completion_tokens", entry.completion_tokens))
                return info.get("finish_reason")
            except (ValueError, IndexError, AttributeError, TypeError):
                log.warning("unreadable info from model %s; its tokens are not counted", entry.model)
                return None
        return None
