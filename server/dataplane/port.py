"""What the data plane's features call (the LLM service, composite endpoints, the safety classifier,
batch rows): the model port.

``server.dataplane.dataplane.DataPlane`` implements it; the features get it at construction and
depend on this declaration, never on ``DataPlane`` or its private members (checked statically by
``tests/unit/test_backend_types.py`` through ``tests/backend_conformance.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

from server.dataplane.signature import ModelSignature
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext


class Answered(NamedTuple):
    """An infer's answer and who answered it (the version, and the traffic split's arm, "" for none)."""

    raw: bytes  # the serialized ModelInferResponse
    version: str
    arm: str


class ModelPort(Protocol):
    @property
    def idempotency(self) -> Any:
        """Where keyed requests' answers are kept (``server.dataplane.idempotency``): a keyed
        generation runs once per tenant, key and body."""

    async def infer(
        self, request: pb.ModelInferRequest, raw: bytes | None = None, timeout: float | None = None, ctx: CallContext | None = None,
        count_tokens: Callable[[bytes], int] | None = None,
    ) -> Answered:  # fmt: skip
        """One request through the admission pipeline to the backend: the answer and who answered."""

    async def submit(self, call: Any, request: pb.ModelInferRequest, data: bytes, signature: ModelSignature) -> bytes:
        """An admitted call's request to the backend through the coalescer (the pipeline already entered)."""

    def resolve_for(self, ctx: CallContext | None, name: str, version: str = "") -> ModelSignature:
        """The model's signature as the caller sees it: authenticated, granted, ready."""

    def signature(self, name: str) -> ModelSignature | None: ...

    def names(self) -> list[str]: ...

    def visible(self, ctx: CallContext | None, names: Iterable[str]) -> list[str]:
        """The names among ``names`` the caller may see."""
