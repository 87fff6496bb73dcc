"""Folders of JSON-lines records that hold customer data: payload logs and shadow records.

One record per line, sealed with the settings' key ring when there is one (``server.control.registry.envelope``:
``{"ts", "tenant", "enc"}``, the record itself AES-GCM sealed and bound to its ``ts`` and ``tenant``),
in clear otherwise. ``ts`` (ISO 8601 or unix seconds) and ``tenant`` stay readable so that retention
(``purge_before``) and erasure (``purge_tenant``) work without the key. A local folder or any fsspec
URL; on a local folder writers and purges take an advisory lock (``.lock``) so a purge never loses
a line appended meanwhile. Rewriting a file goes through a temporary name and a rename.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
from collections.abc import Callable, Iterator
import fcntl

import fsspec

from server.control.registry.envelope import open_line, rewrap_line

log = logging.getLogger(__name__)


def record_time(value) -> float:
    """A record's ``ts`` as unix seconds (ISO 8601 or a number; unreadable: 0, the oldest)."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return 0.0
    return 0.0


class RecordFiles:
    """The files ``<root>/<prefix>*.jsonl`` of one kind of record."""

    def __init__(self, destination: str, prefix: str, keys=None):
        self.destination = destination
        self.prefix = prefix
        self.keys = keys
        self.fs, self.root = fsspec.core.url_to_fs(destination)
        self.root = self.root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols or "local" in protocols

    # ---- locking -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if not self.local:
            yield
            return

        os.makedirs(self.root, exist_ok=True)
        with open(os.path.join(self.root, ".lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # ---- reading -------------------------------------------------------------------------------

    def files(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        return sorted(self.fs.glob(f"{self.root}/{self.prefix}*.jsonl"))

    def _lines(self, path: str) -> list[str]:
        try:
            with self.fs.open(path, "rb") as f:
                return [line.decode("utf-8") for line in f.read().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def read(self, tenant: str | None = None) -> Iterator[dict]:
        """Every record (opened with the key ring), oldest file first; only ``tenant``'s when given."""
        for path in self.files():
            for line in self._lines(path):
                outer = json.loads(line)
                if tenant is not None and outer.get("tenant") != tenant:
                    continue
                yield open_line(self.keys, line)

    # ---- rewriting -----------------------------------------------------------------------------

    def _rewrite(self, keep: Callable[[dict], bool], change: Callable[[str], str] | None = None) -> tuple[int, int]:
        """Keep the lines ``keep(outer)`` says (``change`` applied); returns (lines removed, files deleted)."""
        removed = deleted = 0
        with self.locked():
            for path in self.files():
                lines = self._lines(path)
                kept = [line for line in lines if keep(json.loads(line))]
                if change is not None:
                    kept = [change(line) for line in kept]
                removed += len(lines) - len(kept)
                if not kept:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm(path)
                    deleted += 1
                elif len(kept) != len(lines) or change is not None:
                    tmp = f"{path}.tmp"
                    with self.fs.open(tmp, "wb") as f:
                        f.write(("\n".join(kept) + "\n").encode())
                    self.fs.mv(tmp, path)
        return removed, deleted

    def purge_tenant(self, tenant: str) -> int:
        """Delete every record of ``tenant`` (right to erasure); returns how many."""
        return self._rewrite(lambda outer: outer.get("tenant") != tenant)[0]

    def purge_before(self, cutoff: float) -> int:
        """Delete every record older than ``cutoff`` (unix seconds); returns how many."""
        return self._rewrite(lambda outer: record_time(outer.get("ts")) >= cutoff)[0]

    def rewrap(self) -> int:
        """Re-seal every record's data key under the key ring's primary key; returns records rewritten."""
        if self.keys is None:
            raise ValueError("no key ring: nothing to rewrap")
        count = sum(len(self._lines(p)) for p in self.files())
        self._rewrite(lambda outer: True, lambda line: rewrap_line(self.keys, line))
        return count

    def append(self, lines: list[str], name: str) -> None:
        """Append sealed lines to ``<root>/<name>`` (a file of this kind)."""
        with self.locked():
            self.fs.makedirs(self.root, exist_ok=True)
            with self.fs.open(f"{self.root}/{name}", "ab" if self.local else "wb") as f:  # object stores cannot append
                f.write(("\n".join(lines) + "\n").encode())
