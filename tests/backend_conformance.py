"""Read by mypy, never run: each backend is a ``server.dataplane.backend.Backend`` as written, and
the data plane is the ``server.dataplane.port.ModelPort`` its features call
(``tests/unit/test_backend_types.py`` runs mypy on this file; a signature that drifts from a
protocol fails it)."""

from __future__ import annotations

from server.dataplane.backend import Backend
from server.dataplane.dataplane import DataPlane
from server.dataplane.port import ModelPort
from server.dataplane.replicas import ReplicaSet
from server.dataplane.triton_client import TritonClient
from server.runtime.inprocess import InProcessTriton
from tests.backend_fake import FakeBackend


def backends(one: TritonClient, many: ReplicaSet, local: InProcessTriton, fake: FakeBackend) -> list[Backend]:
    return [one, many, local, fake]


def port(dataplane: DataPlane) -> ModelPort:
    return dataplane
