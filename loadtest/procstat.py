"""CPU seconds consumed by processes under test, read from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parens: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def _own_and_reaped(pid: int) -> float | None:
    """utime+stime of pid plus cutime+cstime (its children that already exited), seconds."""
    f = _stat_fields(pid)
    if f is None:
        return None
    # After the comm field: f[0] is state (field 3), so field k is f[k - 3].
    utime, stime, cutime, cstime = (int(f[k - 3]) for k in (14, 15, 16, 17))
    return (utime + stime + cutime + cstime) / _TICK


def _children(pid: int) -> list[int]:
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tids:
        try:
            out.extend(int(c) for c in (task_dir / tid / "children").read_text().split())
        except FileNotFoundError:
            if (task_dir / tid).exists():  # kernel without CONFIG_PROC_CHILDREN
                return _children_psutil(pid)
        except OSError:
            continue
    return out


def _children_psutil(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def process_tree_cpu(pid: int) -> float | None:
    """CPU seconds of pid and all its live descendants (plus reaped ones); None if gone."""
    own = _own_and_reaped(pid)
    if own is None:
        return None
    total = own
    stack = _children(pid)
    seen = {pid}
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        v = _own_and_reaped(c)
        if v is not None:
            total += v
            stack.extend(_children(c))
    return total


def snapshot(pids: list[int]) -> dict[int, float | None]:
    return {pid: process_tree_cpu(pid) for pid in pids}


def cpu_report(before: dict[int, float | None], after: dict[int, float | None], requests: int) -> dict:
    """Per-pid CPU seconds in the window and CPU milliseconds per request."""
    per_pid = {}
    total = 0.0
    for pid, b in before.items():
        a = after.get(pid)
        if a is None or b is None:
            per_pid[str(pid)] = {"cpu_s": None, "cpu_ms_per_request": None, "note": "process not readable"}
            continue
        used = max(0.0, a - b)
        total += used
        per_pid[str(pid)] = {
            "cpu_s": round(used, 4),
            "cpu_ms_per_request": round(used * 1000 / requests, 5) if requests else None,
        }
    return {
        "pids": per_pid,
        "total_cpu_s": round(total, 4),
        "total_cpu_ms_per_request": round(total * 1000 / requests, 5) if requests else None,
        "clock_tick_s": 1 / _TICK,
    }
