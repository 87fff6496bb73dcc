"""Copy a Triton model repository (or some of its models) from the artifact store into a folder.

    python -m server.runtime.repository_sync --source s3://bucket/model_repository --dest /models \\
        [--models fraud_xgboost,mlp_classifier | --models '*']

Triton pods no longer need it (they read the repository URL and the control plane's reconciler loads
their models: ``server.control.service.reconciler``); it stays for copying a repository to a machine. ``--source`` is any fsspec
URL (``s3://``, ``gs://``, ``file://``, a plain path); each model is the folder ``SOURCE/NAME``
(``config.pbtxt``, version folders, ``inferplane.json``). Files are written to a temporary name and
renamed, so Triton never sees half a file; a file already present with the same size is kept
(re-running after a restart copies only what is missing). Nothing outside ``--dest`` is written:
names with ``..``, absolute paths or other odd parts are refused. A model named in ``--models``
that the source lacks is an error (exit 2) naming it. Artifacts are not verified here; the
adapters check each artifact's sha256 against its config before loading it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from pathlib import Path, PurePosixPath

import fsspec

log = logging.getLogger("inferplane.repository_sync")


class SyncError(Exception):
    """The source or the model list is wrong (names what)."""


def _safe_relative(rel: str) -> PurePosixPath:
    path = PurePosixPath(rel)
    if path.is_absolute() or not path.parts or any(p in ("", ".", "..") for p in path.parts):
        raise SyncError(f"refusing to write {rel!r}: not a plain relative path")
    return path


def sync(source: str, dest: Path, models: list[str] | None = None) -> dict:
    """Copy ``models`` (all when None or ``["*"]``) from ``source`` into ``dest``; returns counts."""
    fs, root = fsspec.core.url_to_fs(source if "://" in source else str(Path(source).resolve()))
    root = root.rstrip("/")
    if not fs.isdir(root):
        if models is None or models == ["*"]:  # an empty bucket (a first rollout): nothing to copy yet
            log.warning("source %s holds no model repository yet: nothing copied", source)
            dest.mkdir(parents=True, exist_ok=True)
            return {"models": [], "copied": 0, "kept": 0}
        raise SyncError(f"source {source} is not a folder")
    available = sorted(PurePosixPath(p.rstrip("/")).name for p in fs.ls(root, detail=False) if fs.isdir(p))
    if models is None or models == ["*"]:
        wanted = available
    else:
        for m in models:
            _safe_relative(m)
        missing = [m for m in models if m not in available]
        if missing:
            raise SyncError(f"source {source} has no model {', '.join(missing)} (it has: {', '.join(available) or 'none'})")
        wanted = models
    dest.mkdir(parents=True, exist_ok=True)
    copied = kept = 0
    for model in wanted:
        _safe_relative(model)
        prefix = f"{root}/{model}"
        for path, info in sorted(fs.find(prefix, detail=True).items()):
            if info.get("type") == "directory":
                continue
            rel = _safe_relative(PurePosixPath(path).relative_to(PurePosixPath(root)).as_posix())
            target = dest.joinpath(*rel.parts)
            size = info.get("size")
            if target.is_file() and size is not None and target.stat().st_size == size:
                kept += 1
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
            try:
                with fs.open(path, "rb") as src, open(partial, "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
            copied += 1
    return {"models": wanted, "copied": copied, "kept": kept}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.runtime.repository_sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="fsspec URL or folder of the model repository")
    parser.add_argument("--dest", required=True, type=Path, help="local folder Triton reads (--model-repository)")
    parser.add_argument("--models", default="*", help="comma-separated model names, or * for all")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    models = [m.strip() for m in args.models.split(",") if m.strip()] or ["*"]
    try:
        result = sync(args.source, args.dest, models)
    except (SyncError, OSError) as err:
        print(f"repository sync failed: {err}", file=sys.stderr)
        return 2
    log.info("synced %s from %s: %d files copied, %d kept", ", ".join(result["models"]) or "no models", args.source, result["copied"], result["kept"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
