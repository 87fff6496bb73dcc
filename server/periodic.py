"""One periodic background task: a coroutine run every ``interval_s`` (after
``first_s``, the interval when not given) on the running loop, from ``start()`` until ``stop()``
(which, with ``final``, runs it once more: a buffer's last flush).
The audit buffer's, the shadow records' and the usage meter's flushes, the replica ledger's sync and
the retention pass run on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


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
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self.final:
            await self.tick()
