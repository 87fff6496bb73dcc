"""The pipeline's batch traffic class: a batch job's row has its own quota charge, holds a slot of
the fair queue's batch class and is metered as ``traffic_class=batch``."""

from __future__ import annotations

import pytest

from server.errors import Overloaded
from server.tenancy.identity import CallContext, Delegation
from server.tenancy.metering import Meter
from server.tenancy.quota_policy import Quota, QuotaPolicy
from tests.unit.test_stream_ledger import KEY, TABULAR, Clock, _pipeline


async def test_a_batch_row_has_its_own_quota_scope_queue_class_and_meter_class():
    meter = Meter(None)
    pipeline = _pipeline(QuotaPolicy(Clock()), meter, quota=Quota(concurrency=1))
    live = await pipeline.admitted(CallContext(KEY), TABULAR.name).open()  # the tenant's one concurrent request
    with pytest.raises(Overloaded):
        await pipeline.admitted(CallContext(KEY), TABULAR.name).open()
    row_ctx = CallContext(priority="batch", delegation=Delegation(live.principal))
    row = await pipeline.admitted(row_ctx, TABULAR.name).open()  # admitted: the batch rows' own charge
    assert row.batch and not live.batch
    assert row.queue.batch_inflight == 1 and row.queue.inflight == 2
    with pytest.raises(Overloaded):  # the batch scope has the tenant's limits too
        await pipeline.admitted(CallContext(priority="batch", delegation=Delegation(live.principal)), TABULAR.name).open()
    live.computed = row.computed = True
    await pipeline.exit(live)
    await pipeline.exit(row)
    assert row.queue.inflight == 0 and row.queue.batch_inflight == 0
    by_class = {r.traffic_class: r.requests for r in meter.drain()}
    assert by_class == {"realtime": 1, "batch": 1}
