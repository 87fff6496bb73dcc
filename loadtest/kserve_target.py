"""KServe's Python model server as a comparison target (issue 30's goals are stated against KServe).

Two halves in one file:

- **the server** (``main``), run by KServe's own environment (``make kserve-env`` builds ``.venv-kserve`` from
  ``requirements/kserve.txt``; it is no part of ``make setup``/``make test``)::

      .venv-kserve/bin/python loadtest/kserve_target.py --model-dir var/model_repository/fraud_xgboost \\
          --grpc-port 8081 --http-port 8080

  A stock ``kserve.ModelServer`` (one process, its defaults: one uvicorn worker, the gRPC v2 / Open Inference
  Protocol server beside the REST one) serving one ``kserve.Model``: the XGBoost booster of a demo model loaded
  from its JSON artifact (never a pickle), ``inplace_predict`` with ``nthread`` = the model's ``threads``
  parameter, as the demo's Triton adapter does. Inputs and outputs carry the demo model's names, types and shapes
  (``fraud_xgboost``: ``features`` FP32[-1, 32] -> ``probability`` FP32[-1, 1]), so the load generator's request
  pool works unchanged. Both servers listen on 127.0.0.1 only (KServe binds every interface by default).

- **the launcher** (``start`` / ``stop``), imported by the benchmark from the project's environment: it starts the
  server as a child, waits until its gRPC ``ModelReady`` answers, and reads KServe's package versions back.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PYTHON = Path(__file__).resolve().parents[1] / ".venv-kserve" / "bin" / "python"
VERSIONED = ("kserve", "xgboost-cpu", "xgboost", "numpy", "grpcio", "protobuf", "fastapi", "uvicorn", "uvloop")
# KServe's shipped defaults log two lines per gRPC call (the method and the stage latencies); "quiet" turns them off
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": ((), {}),
    "quiet": (("--enable_latency_logging", "false"), {"KSERVE_LOGLEVEL": "WARNING"}),
}


# ---------------------------------------------------------------- the server (KServe's environment)


def read_model(model_dir: Path) -> tuple[Path, list[dict], list[dict], int]:
    """(artifact, inputs, outputs, threads) of a demo model directory (``<repository>/<model>``): the signature
    from its ``inferplane.json`` as OIP metadata (shape with -1 for the batch when the model batches), the
    artifact checked against the recorded sha256, ``threads`` from its ``config.pbtxt`` (1 without one). Only
    XGBoost JSON boosters are accepted."""
    doc = json.loads((model_dir / "inferplane.json").read_text())
    if doc.get("format") != "xgboost-json":
        raise ValueError(f"{model_dir}: format {doc.get('format')!r}; only XGBoost JSON boosters are served here (never a pickle)")
    artifact = model_dir / doc["artifact"]
    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    if doc.get("sha256") and digest != doc["sha256"]:
        raise ValueError(f"{artifact}: sha256 {digest} is not the recorded {doc['sha256']}")
    batch = [-1] if doc.get("max_batch_size", 0) > 0 else []

    def oip(specs: list[dict]) -> list[dict]:
        return [{"name": t["name"], "datatype": t["datatype"], "shape": [*batch, *t["dims"]]} for t in specs]

    config = (model_dir / "config.pbtxt").read_text() if (model_dir / "config.pbtxt").exists() else ""
    threads = re.search(r'key:\s*"threads"\s*value\s*\{\s*string_value:\s*"(\d+)"', config)
    return artifact, oip(doc["signature"]["inputs"]), oip(doc["signature"]["outputs"]), int(threads.group(1)) if threads else 1


def _loopback_only() -> None:
    """KServe 0.21 binds its gRPC server to ``[::]`` and uvicorn to ``0.0.0.0``: both to 127.0.0.1 instead."""
    import grpc.aio  # noqa: PLC0415
    import uvicorn  # noqa: PLC0415
    from kserve.protocol.grpc import server as grpc_server  # noqa: PLC0415
    from kserve.protocol.rest import server as rest_server  # noqa: PLC0415

    class Config(uvicorn.Config):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "host": "127.0.0.1"})

    def aio_server(*args, **kwargs):
        server = grpc.aio.server(*args, **kwargs)
        bind = server.add_insecure_port
        server.add_insecure_port = lambda address: bind(address.replace("[::]", "127.0.0.1"))
        return server

    rest_server.uvicorn = type("uvicorn", (), {"Config": Config})
    grpc_server.aio = type("aio", (), {"server": staticmethod(aio_server)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="KServe ModelServer serving a demo XGBoost model (JSON booster)")
    ap.add_argument("--model-dir", type=Path, required=True, help="<repository>/<model> of `inferplane demo build`")
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, required=True)
    args, rest = ap.parse_known_args(argv)
    # kserve.model_server parses sys.argv when imported: only its own flags (``rest``) may be left there
    sys.argv = [sys.argv[0], *rest]

    import kserve  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import xgboost as xgb  # noqa: PLC0415
    from kserve import InferOutput, InferRequest, InferResponse  # noqa: PLC0415

    artifact, inputs, outputs, threads = read_model(args.model_dir)
    if len(inputs) != 1 or len(outputs) != 1:
        raise SystemExit(f"{args.model_dir}: one input and one output expected, got {len(inputs)} / {len(outputs)}")
    out_spec = outputs[0]

    class XGBoostJSON(kserve.Model):
        def load(self) -> bool:
            self.booster = xgb.Booster()
            self.booster.load_model(str(artifact))
            self.booster.set_param({"nthread": threads})
            self.ready = True
            return True

        def get_input_types(self) -> list[dict]:
            return inputs

        def get_output_types(self) -> list[dict]:
            return outputs

        def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
            rows = payload.inputs[0].as_numpy()
            result = self.booster.inplace_predict(rows, validate_features=False).astype(np.float32).reshape(len(rows), -1)
            output = InferOutput(name=out_spec["name"], shape=list(result.shape), datatype=out_spec["datatype"])
            output.set_data_from_numpy(result, binary_data=payload.use_binary_outputs)
            return InferResponse(model_name=self.name, infer_outputs=[output], response_id=payload.id)

    _loopback_only()
    model = XGBoostJSON(args.model_dir.name)
    model.load()
    kserve.ModelServer(http_port=args.http_port, grpc_port=args.grpc_port).start([model])
    return 0


# ---------------------------------------------------------------- the launcher (the project's environment)


@dataclass
class KServeTarget:
    grpc: str  # 127.0.0.1:port of the OIP gRPC server
    http: str  # 127.0.0.1:port of the REST server
    process: subprocess.Popen
    log: Path
    variant: str = "default"
    versions: dict = field(default_factory=dict)


def versions(python: Path) -> dict:
    """The versions of KServe and what it serves with, in the environment of ``python``."""
    code = (
        "import json, importlib.metadata as m\n"
        f"names = {list(VERSIONED)!r}\n"
        "out = {}\n"
        "for n in names:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    return json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout)


def start(model_dir: Path, workdir: Path, *, python: Path = DEFAULT_PYTHON, variant: str = "default",
          timeout: float = 120.0) -> KServeTarget:  # fmt: skip
    """Start the server on ``model_dir`` and return once its gRPC ``ModelReady`` answers true."""
    if not Path(python).exists():
        raise FileNotFoundError(f"{python}: KServe's environment is missing; build it with `make kserve-env`")
    from server.runtime.supervisor import free_port  # noqa: PLC0415 - the project's environment only

    extra, env = VARIANTS[variant]
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"kserve-{variant}.log"
    grpc_port, http_port = free_port(), free_port()
    cmd = [str(python), str(Path(__file__).resolve()), "--model-dir", str(Path(model_dir).resolve()),
           "--grpc-port", str(grpc_port), "--http-port", str(http_port), *extra]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
    target = KServeTarget(f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}", proc, log, variant, versions(python))
    try:
        _wait_ready(target, Path(model_dir).name, timeout)
    except BaseException:
        stop(target)
        raise
    return target


def _wait_ready(target: KServeTarget, model: str, timeout: float) -> None:
    import grpc  # noqa: PLC0415

    from server.protogen.inference import grpc_service_pb2 as pb  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target.grpc) as channel:
        ready = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelReady",
            request_serializer=pb.ModelReadyRequest.SerializeToString,
            response_deserializer=pb.ModelReadyResponse.FromString,
        )
        while time.monotonic() < deadline:
            if target.process.poll() is not None:
                raise RuntimeError(f"KServe exited with {target.process.returncode}:\n{target.log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(grpc.RpcError):
                if ready(pb.ModelReadyRequest(name=model), timeout=2).ready:
                    return
            time.sleep(0.2)
    raise RuntimeError(f"KServe ({target.grpc}) not ready in {timeout:.0f} s:\n{target.log.read_text(errors='replace')[-3000:]}")


def stop(target: KServeTarget) -> int | None:
    """SIGTERM (KServe's graceful stop), SIGKILL to its process group after 15 s; its exit code."""
    with contextlib.suppress(ProcessLookupError):
        target.process.send_signal(signal.SIGTERM)
    try:
        return target.process.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(target.process.pid, signal.SIGKILL)
        return target.process.wait(10)


if __name__ == "__main__":
    raise SystemExit(main())
