"""One periodic background task: a coroutine run every ``interval_s`` (after
``first_s``, the interval when not given) on the running loop, from ``start()`` until ``stop()``
(which, with ``final``, runs it once more: a buffer's last flush). ``stop_tasks``: how every room stops
its background tasks (cancel them all, then wait for each; what it raised ends with it).
The audit buffer's, the shadow records' and the usage meter's flushes, the replica ledger's sync and
the retention pass run on it. ``Buffer`` is the flushed kind: records added on the request path,
written in batches off the loop (the audit buffer, the shadow records).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def stop_tasks(tasks) -> None:
    """Cancel every task, then wait for each (what it raised, cancelled or not, ends with it)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass


class Periodic:
    def __init__(
        self, name: str, interval_s: float, tick: Callable[[], Awaitable[object]], *, first_s: float | None = None, final: bool = False
    ):
        self.name = name
        self.interval_s = interval_s
        self.first_s = interval_s if first_s is None else first_s
        self.tick = tick
        self.final = final
        self._task: asyncio.Task | None = None

    async def run(self) -> None:
        await asyncio.sleep(self.first_s)
        while True:
            await self.tick()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait for it (what it raised, cancelled or not, ends with it); with
        ``final``, one more tick."""
        task, self._task = self._task, None
        if task is not None:
            await stop_tasks((task,))
        if self.final:
            await self.tick()


class Buffer(Periodic):
    """Records added on the request path (at most ``capacity``: when full, the oldest goes), written every
    ``interval_s`` in one batch by ``write`` in a thread (``start()``), and once more at ``stop()``.
    ``write`` returns how many it wrote (None: all); a failed write is logged and ``_failed(batch)`` runs."""

    what = "records"  # in the log line of a failed write

    def __init__(self, name: str, interval_s: float, write: Callable[[list[dict]], int | None], capacity: int):
        self._write_batch = write
        self._pending: deque[dict] = deque(maxlen=capacity)
        self.dropped = 0
        super().__init__(name, interval_s, self.flush, final=True)

    async def flush(self) -> int:
        if not self._pending:
            return 0
        batch = list(self._pending)
        self._pending.clear()
        try:
            n = await asyncio.to_thread(self._write_batch, batch)
        except Exception as err:
            log.warning("writing %d %s failed: %s", len(batch), self.what, type(err).__name__)
            self._failed(batch)
            return 0
        return self._written(len(batch) if n is None else n)

    def _failed(self, batch: list[dict]) -> None:
        """A write failed: the batch is lost, counted in ``dropped``."""
        self.dropped += len(batch)

    def _written(self, n: int) -> int:
        return n
