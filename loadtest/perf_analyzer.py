"""NVIDIA's perf_analyzer, fetched from the tritonclient 2.51.0 wheel, as a reference client.

`ensure_binary()` downloads the wheel once (pip), unpacks `perf_analyzer` into
~/.cache/inferplane/perf_analyzer/bin and makes its two non-system libraries (libb64,
libcudart) resolvable by symlinking the copies bundled in the nvidia-pytriton wheel into
.../lib. `run_perf_analyzer()` runs it against a gRPC target and returns the loadtest JSON
shape (throughput, latency percentiles in ms) per concurrency level.
"""

from __future__ import annotations

import csv
import fcntl
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from loadtest.protocol import parse_grpc_target

TRITONCLIENT_VERSION = "2.51.0"
_MEMBER = f"tritonclient-{TRITONCLIENT_VERSION}.data/data/bin/perf_analyzer"
# plain soname -> glob of the hashed copy in nvidia_pytriton.libs
_LIBS = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


def cache_dir() -> Path:
    env = os.environ.get("INFERPLANE_PERF_ANALYZER_CACHE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "inferplane" / "perf_analyzer"


@contextmanager
def _locked(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pytriton_libs_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    candidates = []
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).resolve().parent.parent / "nvidia_pytriton.libs")
    for p in sys.path:
        candidates.append(Path(p) / "nvidia_pytriton.libs")
    for c in candidates:
        if c.is_dir():
            return c
    raise FileNotFoundError(
        "nvidia_pytriton.libs not found: install nvidia-pytriton (it bundles libb64 and libcudart)"
    )


def _link_libs(lib_dir: Path) -> None:
    src_dir = _pytriton_libs_dir()
    lib_dir.mkdir(parents=True, exist_ok=True)
    for name, pattern in _LIBS.items():
        matches = sorted(src_dir.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"{pattern} not found in {src_dir}")
        link = lib_dir / name
        if link.is_symlink() and link.resolve() == matches[0].resolve():
            continue
        tmp = lib_dir / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(matches[0])
        os.replace(tmp, link)


def _download_wheel(wheels: Path) -> Path:
    found = sorted(wheels.glob(f"tritonclient-{TRITONCLIENT_VERSION}-*.whl"))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         f"tritonclient=={TRITONCLIENT_VERSION}", "-d", str(wheels)],
        check=True,
    )
    found = sorted(wheels.glob(f"tritonclient-{TRITONCLIENT_VERSION}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download left no tritonclient {TRITONCLIENT_VERSION} wheel in {wheels}")
    return found[0]


def lib_env(base: Path | None = None, env: dict | None = None) -> dict:
    """Environment in which perf_analyzer finds its libraries."""
    env = dict(os.environ if env is None else env)
    lib = str((base or cache_dir()) / "lib")
    env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def wrapper_script(cache: Path | None = None) -> Path:
    """A script that runs perf_analyzer on its own (it sets the library path the binary needs):
    what to hand a user, instead of a binary that fails to start without LD_LIBRARY_PATH."""
    base = Path(cache) if cache else cache_dir()
    binary = ensure_binary(base)
    script = base / "perf_analyzer"
    text = f'#!/bin/sh\nLD_LIBRARY_PATH="{base / "lib"}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "{binary}" "$@"\n'
    if not script.is_file() or script.read_text() != text:
        tmp = script.with_name(".perf_analyzer.sh.tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, script)
    return script


def ensure_binary(cache: Path | None = None) -> Path:
    """Path to a runnable perf_analyzer (downloading and unpacking it on first use)."""
    base = Path(cache) if cache else cache_dir()
    binary = base / "bin" / "perf_analyzer"
    with _locked(base):
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            wheel = _download_wheel(base / "wheels")
            binary.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as zf, zf.open(_MEMBER) as src:
                fd, tmp = tempfile.mkstemp(dir=binary.parent, prefix=".perf_analyzer.")
                with os.fdopen(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            os.chmod(tmp, 0o755)
            os.replace(tmp, binary)
        _link_libs(base / "lib")
    return binary


def version(cache: Path | None = None) -> str:
    binary = ensure_binary(cache)
    p = subprocess.run([str(binary), "--version"], env=lib_env(cache), capture_output=True, text=True, timeout=30)
    return (p.stdout or p.stderr).strip()


def _ms(row: dict, key: str) -> float | None:
    v = row.get(key)
    return float(v) / 1000.0 if v not in (None, "") else None


def parse_csv(text: str, *, batch: int = 1) -> list[dict]:
    """perf_analyzer's -f CSV (latencies in µs) -> points in the loadtest result shape."""
    points = []
    for row in csv.DictReader(io.StringIO(text)):
        row = {k.strip(): (v.strip() if isinstance(v, str) else v) for k, v in row.items() if k}
        infer_s = float(row["Inferences/Second"])
        point = {
            "throughput_rps": infer_s / batch,
            "inferences_per_s": infer_s,
            "latency_ms": {
                "p50": _ms(row, "p50 latency"),
                "p90": _ms(row, "p90 latency"),
                "p95": _ms(row, "p95 latency"),
                "p99": _ms(row, "p99 latency"),
                "mean": _ms(row, "Avg latency"),
            },
        }
        if "Concurrency" in row:
            point["concurrency"] = int(float(row["Concurrency"]))
        if "Request Rate" in row:
            point["rate"] = float(row["Request Rate"])
        points.append(point)
    return points


def run_perf_analyzer(
    target: str,
    model: str,
    *,
    concurrency_range: str = "1",
    measurement_interval_ms: int = 5000,
    batch: int = 1,
    extra_args: list[str] | tuple[str, ...] = (),
    timeout: float | None = 900,
    cache: Path | None = None,
) -> dict:
    """Run perf_analyzer (gRPC) and return {"points": [...], ...} in the loadtest shape.

    concurrency_range: "N" or "start:end:step" as perf_analyzer takes it.
    """
    binary = ensure_binary(cache)
    address = parse_grpc_target(target)
    with tempfile.TemporaryDirectory(prefix="perf_analyzer.") as tmp:
        out_csv = Path(tmp) / "out.csv"
        cmd = [
            str(binary), "-i", "grpc", "-u", address, "-m", model, "-b", str(batch),
            "--concurrency-range", str(concurrency_range),
            "--measurement-interval", str(measurement_interval_ms),
            "-f", str(out_csv), *extra_args,
        ]
        p = subprocess.run(cmd, env=lib_env(cache), capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not out_csv.is_file():
            raise RuntimeError(
                f"perf_analyzer exited {p.returncode}: {(p.stderr or p.stdout).strip()[-2000:]}"
            )
        points = parse_csv(out_csv.read_text(), batch=batch)
    # Without server-side statistics the CSV has no "Avg latency"; the log always does.
    means = [int(m) / 1000.0 for m in re.findall(r"Avg latency: (\d+) usec", p.stdout)]
    if len(means) == len(points):
        for point, mean in zip(points, means):
            if point["latency_ms"]["mean"] is None:
                point["latency_ms"]["mean"] = mean
    result = {
        "tool": "perf_analyzer",
        "tool_version": TRITONCLIENT_VERSION,
        "target": target,
        "model": model,
        "protocol": "grpc",
        "mode": "closed",
        "batch": batch,
        "measurement_interval_ms": measurement_interval_ms,
        "command": cmd,
        "points": points,
    }
    if len(points) == 1:
        result.update(points[0])
    return result
