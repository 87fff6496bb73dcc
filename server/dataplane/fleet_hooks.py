"""What the fleet (replicas, autoscaler, signals) reads and sets in a data plane, handed over at
build time instead of reached for afterwards.

``build_dataplane(..., hooks=FleetHooks())`` fills ``queues`` with the pipeline's fair queues (read
for in-flight and queue depth), gives the model table ``wakers`` (the autoscaler puts a waker there
when it scales a model to zero; the pipeline holds the next request through it) and wraps the usage
meter in ``usage`` (cumulative requests and tokens per model, for QPS and tokens/s). The caller keeps
the object and hands it to the control plane.
"""

from __future__ import annotations


class UsageTap:
    """The pipeline's meter, counting per model on the way through (then the real meter, if any)."""

    def __init__(self, meter=None):
        self.meter = meter
        self.requests: dict[str, int] = {}
        self.tokens: dict[str, int] = {}

    def record(
        self, tenant: str, team: str, model: str, version: str, *, input_tokens: int = 0, output_tokens: int = 0, compute_us: int = 0,
        traffic_class: str = "realtime",
    ) -> None:
        self.requests[model] = self.requests.get(model, 0) + 1
        tokens = input_tokens + output_tokens
        if tokens:
            self.tokens[model] = self.tokens.get(model, 0) + tokens
        if self.meter is not None:
            self.meter.record(
                tenant, team, model, version, input_tokens=input_tokens, output_tokens=output_tokens, compute_us=compute_us,
                traffic_class=traffic_class,  # a batch job's rows are metered apart (server.control.batches.batches)
            )  # fmt: skip

    async def stop(self) -> None:
        if self.meter is not None:
            await self.meter.stop()


class FleetHooks:
    def __init__(self) -> None:
        self.wakers: dict[str, object] = {}
        self.queues: dict = {}  # model -> batching.fair_queue.FairQueue (the pipeline's own dict)
        self.usage = UsageTap()
