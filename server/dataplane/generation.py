"""The LLM service: what the OpenAI REST handlers, the gRPC ``Generate`` servicer, batch rows and
composite endpoint nodes call for LLMs and embedding models. Knows nothing of aiohttp, the
caller-facing gRPC, the pipeline or the backend: every call goes through the model port
(``server.dataplane.port``), whose generations are the data plane's (``server.dataplane.engine_calls``)
and whose embeddings are ModelInfer calls through the one admission pipeline like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from server.dataplane import codecs
from server.dataplane.port import Chunk, GenerateParams, ModelPort
from server.dataplane.signature import ModelSignature, is_llm, require_llm
from server.errors import BackendError, InferplaneError, InvalidRequest
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext

EMBEDDING_INPUT = "text"
EMBEDDING_OUTPUT = "embedding"
TOKENS_OUTPUT = "tokens"
ADAPTERS_TTL_S = 5.0  # how stale GET /v1/models's adapter list may be


def is_embedding(signature: ModelSignature) -> bool:
    return EMBEDDING_INPUT in signature.inputs and EMBEDDING_OUTPUT in signature.outputs


def _tokens(outputs: dict[str, np.ndarray]) -> int:
    """The input tokens an embedding answer covered (its ``tokens`` output; 0 without one)."""
    return int(outputs[TOKENS_OUTPUT].sum()) if TOKENS_OUTPUT in outputs else 0


def _input_tokens(raw: bytes) -> int:
    """:func:`_tokens` of a serialized answer: what the data plane meters and charges."""
    return _tokens(codecs.output_arrays(pb.ModelInferResponse.FromString(raw)))


class LLMService:
    """Generation and embeddings for the transports, over the model port they are given."""

    def __init__(self, port: ModelPort):
        self._port = port
        self._adapters: dict[str, tuple[float, list[str]]] = {}  # model -> (read at, its LoRA adapters)

    # ---- model lookups ------------------------------------------------------------------

    def llm(self, name: str, ctx: CallContext | None = None) -> ModelSignature:
        signature = self._port.resolve_for(ctx, name)
        require_llm(name, signature)
        return signature

    async def listed(self, ctx: CallContext | None = None) -> list[tuple[str, str, str]]:
        """(name, kind, parent) for each served LLM, embedding model and LoRA adapter (``model:adapter``,
        kind ``lora``, parent its model) the caller may see."""
        out = []
        llms = []
        for name in self._port.names():
            signature = self._port.signature(name)
            if signature is None:
                continue
            if is_llm(signature):
                llms.append(name)
                out.append((name, "llm", ""))
            elif is_embedding(signature):
                out.append((name, "embedding", ""))
        visible = set(self._port.visible(ctx, [n for n, _, _ in out]))
        out = [entry for entry in out if entry[0] in visible]
        for name in llms:
            adapters = [f"{name}:{a}" for a in await self._adapters_of(name)]
            out.extend((full, "lora", name) for full in self._port.visible(ctx, adapters))
        return out

    async def _adapters_of(self, model: str) -> list[str]:
        """The adapters the model's engine holds (its stats; read at most every ADAPTERS_TTL_S)."""
        now = time.monotonic()
        cached = self._adapters.get(model)
        if cached is not None and now - cached[0] < ADAPTERS_TTL_S:
            return cached[1]
        try:
            names = [a for a in (await self._port.engine_stats(model)).get("adapters", []) if isinstance(a, str)]
        except (InferplaneError, asyncio.TimeoutError, ValueError):
            return cached[1] if cached is not None else []  # an engine still starting lists none yet
        self._adapters[model] = (now, names)
        return names

    # ---- generation ---------------------------------------------------------------------

    def generate(
        self, model: str, params: GenerateParams, timeout: float | None = None, ctx: CallContext | None = None
    ) -> AsyncIterator[Chunk]:
        """The engine's chunks (``ModelPort.generate``); the last has ``finish_reason``. Raises domain errors."""
        return self._port.generate(model, params, timeout, ctx)

    async def complete(
        self, model: str, params: GenerateParams, timeout: float | None = None, ctx: CallContext | None = None
    ) -> Chunk:
        """The whole answer: the final chunk (its reason and counts) with every chunk's text joined;
        the one join of a generation (the non-streaming OpenAI answers, a batch row's, a composite's)."""
        parts, last = [], None
        async with contextlib.aclosing(self.generate(model, params, timeout, ctx)) as chunks:
            async for chunk in chunks:
                parts.append(chunk.text)
                last = chunk
        if last is None:
            raise BackendError("the model sent no response")
        last.text = "".join(parts)
        return last

    async def engine_stats(self, model: str, ctx: CallContext | None = None) -> dict[str, Any]:
        """The engine's counters (steps, queue, prefix-cache hits, recent sequences): an operator's
        read, not a request (outside the pipeline: no quota, no queue)."""
        self.llm(model, ctx)
        return await self._port.engine_stats(model)

    # ---- embeddings ---------------------------------------------------------------------

    async def embed(
        self, model: str, texts: list[str], timeout: float | None = None, ctx: CallContext | None = None
    ) -> tuple[np.ndarray, int]:
        """L2-normalized embeddings ``[n, dim]`` FP32 and the number of tokens they covered; each
        batch of up to the model's max batch size is one ModelInfer through the pipeline."""
        signature = self._port.resolve_for(ctx, model)
        if not is_embedding(signature):
            raise InvalidRequest(f"model '{model}' is not an embedding model")
        if not texts:
            raise InvalidRequest("input must not be empty")
        limit = signature.max_batch_size or 1
        vectors, tokens = [], 0
        for start in range(0, len(texts), limit):
            batch = texts[start : start + limit]
            request = pb.ModelInferRequest(model_name=model)
            request.inputs.add(name=EMBEDDING_INPUT, datatype="BYTES", shape=[len(batch), 1])
            request.raw_input_contents.append(codecs.serialize_bytes([t.encode("utf-8") for t in batch]))
            raw = (await self._port.infer(request, timeout=timeout, ctx=ctx, count_tokens=_input_tokens)).raw
            outputs = codecs.output_arrays(pb.ModelInferResponse.FromString(raw))
            if EMBEDDING_OUTPUT not in outputs:
                raise BackendError(f"model '{model}' returned no '{EMBEDDING_OUTPUT}' output")
            vectors.append(outputs[EMBEDDING_OUTPUT].reshape(len(batch), -1))
            tokens += _tokens(outputs)
        return np.concatenate(vectors, axis=0), tokens
