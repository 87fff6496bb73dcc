# syntax=docker/dockerfile:1
# inferplane images. Two targets:
#
#   docker build -t inferplane .                          # the frontend (the default, last target)
#   docker build --target triton   -t inferplane-triton . # NVIDIA's Triton with the project's adapters
#
# One box: `docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 inferplane` serves the demo models
# with the embedded Triton (tritonserver 2.51 from the nvidia-pytriton wheel).
#
# Kubernetes (deploy/): the frontend image runs `inferplane serve --triton-url triton-GROUP:8001` and
# the model-repository sync init container; the triton image runs each model group's Triton. Both
# run as uid 10001 without a shell login, with no compiler in the final stages.
#
# Extra fsspec backends for the artifact store: --build-arg EXTRA_PIP="s3fs==2025.*" (or gcsfs, adlfs).

# ---- builder: compilers, wheels that may need them, the demo models ---------------------------------
FROM python:3.11.11-slim-bookworm AS builder
ARG EXTRA_PIP=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint (tests/unit/test_dockerfile.py): DL3008, Debian packages unpinned (the base image is pinned; bookworm's
# security updates replace exact versions); DL3025, HEALTHCHECK in shell form (its `|| exit 1`)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential libgomp1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY server ./server
COPY batching ./batching
COPY model_repository ./model_repository
COPY optimizer ./optimizer
COPY loadtest ./loadtest
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install '.[cpu]' ${EXTRA_PIP} \
    && /opt/venv/bin/inferplane demo build --out /opt/demo_models --no-llm --no-smollm2

# ---- triton: NVIDIA's Triton container with the project's Python-backend adapters -------------------
# The deployer picks the backend per version from what this Triton's backend directory holds
# (server/control/registry/backend_configs.py, `choose`): versions that ask for a GPU get the native backends
# (onnxruntime with the CUDA/TensorRT providers, tensorrt for plans, fil for trees, vllm for LLMs); CPU
# versions, and formats a native backend cannot serve, run through the project's adapters on the python backend.
FROM nvcr.io/nvidia/tritonserver:24.10-py3 AS triton
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH=/opt/inferplane/adapters
# the adapters' own imports, as wheels (no compiler needed)
RUN python3 -m pip install --only-binary=:all: 'numpy>=1.26,<2' 'onnxruntime>=1.18' 'xgboost>=2.0' 'lightgbm>=4.3' \
    && groupadd --gid 10001 inferplane \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin inferplane
COPY model_repository/adapters /opt/inferplane/adapters
COPY batching/kv_budget.py /opt/inferplane/adapters/kv_budget.py
COPY --chmod=0755 deploy/triton-entrypoint.sh /opt/inferplane/triton-entrypoint.sh
USER 10001:10001
EXPOSE 8000 8001 8002
# hadolint ignore=DL3025
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD curl -fsS http://127.0.0.1:8000/v2/health/ready || exit 1
ENTRYPOINT ["/opt/inferplane/triton-entrypoint.sh"]

# ---- frontend: the runtime only ---------------------------------------------------------------------
FROM python:3.11.11-slim-bookworm AS frontend
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH INFERPLANE_WORKDIR=/tmp/inferplane
# libgomp for LightGBM/XGBoost; the Triton binary's other libraries ship inside the wheel
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 inferplane \
    && useradd --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin inferplane
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=10001:10001 /opt/demo_models /app/var/model_repository
WORKDIR /app
USER 10001:10001
EXPOSE 8000 8001 8002
# hadolint ignore=DL3025
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD python -c "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
c = grpc.insecure_channel('127.0.0.1:8001'); \
sys.exit(0 if g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=2).status == 1 else 1)"
CMD ["inferplane", "serve", "--host", "0.0.0.0", "--model-repository", "/app/var/model_repository", "--workdir", "/tmp/inferplane"]
