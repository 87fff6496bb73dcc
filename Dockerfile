# inferplane: the frontend with the embedded Triton (nvidia-pytriton wheel), serving the demo models.
#
#   docker build -t inferplane .
#   docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 inferplane
#
# Production, against the NVIDIA Triton container: run Triton yourself with the repository the
# platform writes, in explicit model-control mode, and point the same frontend at it. The frontend
# then starts no Triton of its own; models, signatures and traffic policy do not change.
#
#   docker run --gpus all --rm -p 9001:8001 -v $PWD/var/model_repository:/models \
#       nvcr.io/nvidia/tritonserver:24.10-py3 tritonserver --model-repository=/models \
#       --model-control-mode=explicit --disable-auto-complete-config
#   docker run --rm --network host inferplane \
#       inferplane serve --host 0.0.0.0 --triton-url 127.0.0.1:9001
#
# The Triton container's native backends (onnxruntime, tensorrt, fil, python) replace the
# Python-backend adapters where the deployer writes configs for them; a GPU image installs the
# `gpu` extra (xgboost with CUDA, onnxruntime-gpu) instead of `cpu`.

FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# libgomp for LightGBM/XGBoost; the Triton binary's other libraries ship inside the wheel.
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY server ./server
COPY batching ./batching
COPY model_repository ./model_repository
COPY optimizer ./optimizer
COPY loadtest ./loadtest
RUN pip install '.[cpu]' && inferplane demo build --out /app/var/model_repository

EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD python -c "import grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
import sys; c=grpc.insecure_channel('127.0.0.1:8001'); \
sys.exit(0 if g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=2).status == 1 else 1)"

CMD ["inferplane", "serve", "--host", "0.0.0.0", "--model-repository", "/app/var/model_repository", "--workdir", "/app/var/run"]
