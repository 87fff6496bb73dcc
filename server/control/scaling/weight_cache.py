"""A local cache of the artifacts of recently scaled-to-zero models.

When an endpoint deployed from the registry scales to zero, its artifacts leave the Triton model
repository (``stash``: moved into the cache, named by sha256, nothing copied); when it wakes,
``restore`` puts them back from the cache (a *hit*: a rename or a local copy) or, once evicted,
from the artifact store (a *miss*: the store's bytes, digest-verified by the store). The cache
keeps at most ``max_bytes``, evicting the least recently stashed first. Only version folders the
deployer wrote (they carry ``inferplane_version.json`` naming the artifact and its sha256) take
part; a hand-written repository entry keeps its files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

VERSION_FILE = "inferplane_version.json"  # written by server.control.rollout.deployer
HIT, MISS, PRESENT, NONE = "hit", "miss", "present", "none"


class WeightCache:
    def __init__(self, root: Path, max_bytes: int = 2 << 30):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0

    def _path(self, sha256: str) -> Path:
        return self.root / sha256

    def has(self, sha256: str) -> bool:
        return self._path(sha256).is_file()

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*") if p.is_file()) if self.root.is_dir() else 0

    def stash(self, model_dir: Path) -> list[str]:
        """Move the artifacts of every deployed version under ``model_dir`` into the cache."""
        stashed = []
        self.root.mkdir(parents=True, exist_ok=True)
        for pin, artifact in _pinned(model_dir):
            if not artifact.is_file():
                continue
            target = self._path(pin["sha256"])
            if target.is_file():
                artifact.unlink()
            else:
                shutil.move(str(artifact), target)
            os.utime(target)  # recency: the LRU order
            stashed.append(pin["sha256"])
        self._evict()
        return stashed

    def restore(self, model_dir: Path, store=None) -> str:
        """Put back every deployed version's artifact: ``hit`` (from the cache), ``miss`` (from the
        artifact store), ``present`` (never left), ``none`` (nothing deployed there)."""
        outcome = NONE
        for pin, artifact in _pinned(model_dir):
            if artifact.is_file():
                outcome = outcome if outcome in (HIT, MISS) else PRESENT
                continue
            cached = self._path(pin["sha256"])
            if cached.is_file():
                tmp = artifact.with_name(f".{artifact.name}.restoring")
                shutil.copyfile(cached, tmp)
                os.replace(tmp, artifact)
                os.utime(cached)
                self.hits += 1
                outcome = HIT if outcome != MISS else MISS
            elif store is not None:
                store.copy_to(pin["sha256"], artifact)
                self.misses += 1
                outcome = MISS
            else:
                raise FileNotFoundError(f"{artifact} is neither in the weight cache nor in an artifact store")
        return outcome

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _evict(self) -> None:
        files = sorted((p for p in self.root.glob("*") if p.is_file()), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        while files and total > self.max_bytes:
            victim = files.pop(0)
            total -= victim.stat().st_size
            victim.unlink(missing_ok=True)
            log.info("weight cache: evicted %s", victim.name)


def _pinned(model_dir: Path):
    """(pin, artifact path) of each version folder the deployer wrote under ``model_dir``."""
    if not Path(model_dir).is_dir():
        return
    for version_dir in sorted(p for p in Path(model_dir).iterdir() if p.is_dir() and p.name.isdigit()):
        pin_file = version_dir / VERSION_FILE
        if not pin_file.is_file():
            continue
        try:
            pin = json.loads(pin_file.read_text())
        except ValueError:
            continue
        if isinstance(pin.get("artifact"), str) and isinstance(pin.get("sha256"), str) and "/" not in pin["artifact"]:
            yield pin, version_dir / pin["artifact"]
