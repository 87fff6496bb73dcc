"""Live progress: a rich bar with phase, QPS and error count. A no-op when quiet."""

from __future__ import annotations

import time


class LiveProgress:
    def __init__(self, label: str, warmup: float, duration: float, *, quiet: bool = False) -> None:
        self.quiet = quiet
        self.total = warmup + duration
        self.warmup = warmup
        self._last = (time.monotonic(), 0)
        self._qps = 0.0
        self._progress = None
        if quiet:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[phase]:>7}"),
            TextColumn("qps [cyan]{task.fields[qps]:>9.1f}"),
            TextColumn("ok [green]{task.fields[ok]:>9}"),
            TextColumn("err [red]{task.fields[err]:>6}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            auto_refresh=False,
            transient=False,
        )
        self._task = self._progress.add_task(label, total=self.total, phase="warmup", qps=0.0, ok=0, err=0)

    def __enter__(self) -> "LiveProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.refresh()
            self._progress.stop()

    def update(self, elapsed: float, ok: int, err: int) -> None:
        if self._progress is None:
            return
        now = time.monotonic()
        t_last, ok_last = self._last
        if now - t_last >= 0.2:
            self._qps = (ok - ok_last) / (now - t_last)
            self._last = (now, ok)
        if elapsed < self.warmup:
            phase = "warmup"
        elif elapsed < self.total:
            phase = "measure"
        else:
            phase = "drain"
        self._progress.update(
            self._task, completed=min(elapsed, self.total), phase=phase, qps=self._qps, ok=ok, err=err
        )
        self._progress.refresh()
