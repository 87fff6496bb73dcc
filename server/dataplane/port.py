"""What the data plane's features call (the LLM service, composite endpoints, the safety classifier,
batch rows): the model port, and the values it answers with.

``server.dataplane.dataplane.DataPlane`` implements it; the features get it at construction and
depend on this declaration, never on ``DataPlane``, the pipeline, the backend or their private
members (checked statically by ``tests/unit/test_backend_types.py`` through
``tests/backend_conformance.py``; their imports by ``tests/unit/test_layout.py``). A call is made on
the caller's behalf by its ``CallContext`` (its ``delegation`` for a feature calling for someone);
who answered (the version, the traffic split's arm) comes back in the value, not in the context.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from server.dataplane.signature import ModelSignature
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext


class Answered(NamedTuple):
    """An infer's answer and who answered it (the version, and the traffic split's arm, "" for none)."""

    raw: bytes  # the serialized ModelInferResponse
    version: str
    arm: str


@dataclass
class GenerateParams:
    """One generation request, transport-neutral (the engine's ``parameters`` JSON)."""

    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    deadline_ms: float | None = None

    def engine_parameters(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for key in ("max_tokens", "temperature", "top_p", "seed", "deadline_ms"):
            value = getattr(self, key)
            if value is not None:
                doc[key] = value
        if self.stop:
            doc["stop"] = list(self.stop)
        if self.ignore_eos:
            doc["ignore_eos"] = True
        return doc


@dataclass
class Chunk:
    """New text from one engine response; ``finish_reason`` is set on the last one only."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    step: int = 0
    version: str = ""  # the version that answered
    arm: str = ""  # the traffic split's arm that answered ("" for none)


class ModelPort(Protocol):
    async def infer(
        self, request: pb.ModelInferRequest, raw: bytes | None = None, timeout: float | None = None, ctx: CallContext | None = None,
        count_tokens: Callable[[bytes], int] | None = None,
    ) -> Answered:  # fmt: skip
        """One request through the admission pipeline to the backend: the answer and who answered."""

    def generate(
        self, model: str, params: GenerateParams, timeout: float | None = None, ctx: CallContext | None = None
    ) -> AsyncIterator[Chunk]:
        """One generation (``model`` or ``model:adapter``) through the admission pipeline to the LLM
        engine: its chunks, the last with ``finish_reason``, each naming the version and arm that
        answered. Raises domain errors; leaving the iterator early cancels the engine's stream."""

    async def engine_stats(self, model: str) -> dict[str, Any]:
        """The LLM engine's counters (steps, queue, prefix-cache hits, its LoRA adapters): an
        operator's read outside the pipeline (no quota, no queue; the caller checks the grant)."""

    async def submit(self, call: Any, request: pb.ModelInferRequest, data: bytes, signature: ModelSignature) -> bytes:
        """An admitted call's request to the backend through the coalescer (the pipeline already entered)."""

    def resolve_for(self, ctx: CallContext | None, name: str, version: str = "") -> ModelSignature:
        """The model's signature as the caller sees it: authenticated, granted, ready."""

    def signature(self, name: str) -> ModelSignature | None: ...

    def names(self) -> list[str]: ...

    def visible(self, ctx: CallContext | None, names: Iterable[str]) -> list[str]:
        """The names among ``names`` the caller may see."""
