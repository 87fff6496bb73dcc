"""The model table: what Triton serves here (signatures and ready versions), what the operator
asked to be loaded, and whether the backend is up. The pipeline resolves requests against it; the
data plane's control methods keep it in step with Triton.
"""

from __future__ import annotations

from collections.abc import Mapping

from server.dataplane.signature import ModelSignature, version_key
from server.errors import BackendUnavailable, ModelNotFound, ModelNotReady


class Asleep(ModelNotReady):
    """The model is scaled to zero. ``await err.waker.wait(timeout)`` loads it (one load, however
    many callers wait) or raises ``MODEL_NOT_READY`` with a retry hint past its cold-start budget;
    the pipeline's resolve step holds the request through it (``Pipeline._resolve_held``)."""

    waker = None


class ModelTable:
    def __init__(self, wakers: Mapping[str, object] | None = None) -> None:
        self.signatures: dict[str, ModelSignature] = {}
        self.loaded: set[str] = set()  # what the operator asked for; reloaded after a Triton restart
        self.backend_up = True
        # scaled-to-zero models: name -> a waker (``server.control.scaling.autoscaler``), owned by the caller
        self.wakers: Mapping[str, object] = wakers if wakers is not None else {}

    def resolve(self, name: str, version: str = "") -> ModelSignature:
        """The signature serving (name, version); NOT_FOUND / UNAVAILABLE otherwise."""
        if not self.backend_up:
            raise BackendUnavailable("Triton is restarting; retry shortly", retry_after_s=1.0)
        signature = self.signatures.get(name)
        if signature is None:
            waker = self.wakers.get(name)
            if waker is not None:
                asleep = Asleep(f"model '{name}' is scaled to zero and loading", retry_after_s=1.0)
                asleep.waker = waker
                raise asleep
            if name in self.loaded:
                raise ModelNotReady(f"model '{name}' is loading or failed to load", retry_after_s=1.0)
            raise ModelNotFound(f"unknown model '{name}'")
        if version and version not in signature.versions:
            raise ModelNotFound(
                f"unknown version '{version}' of model '{name}' (ready versions: {sorted(signature.versions, key=version_key)})"
            )
        return signature

    def names(self) -> list[str]:
        """Every model served or asked for (ready or not), sorted."""
        return sorted(set(self.signatures) | self.loaded)
