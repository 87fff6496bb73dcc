#!/bin/sh
# Entrypoint of the Triton image (Dockerfile target `triton`): serve the one model repository every
# Triton reads (INFERPLANE_MODEL_REPOSITORY: a folder, or s3:// gs:// as:// which Triton reads natively)
# in explicit model-control mode, loading nothing at start: the control plane's reconciler
# (server/control/service/reconciler.py) loads what is placed on this Triton, so a Triton joining late or
# restarting converges by itself, and an empty bucket on the first rollout is no error
# (--exit-on-error=false: a repository Triton cannot read yet does not stop it); the reconciler keeps up
# to 4 loads in flight and --model-load-thread-count=4 lets Triton run them at once.
#   INFERPLANE_GROUP_MODELS  optional, for a Triton run without the control plane: comma-separated
#                            model names, or * for every model in the repository, loaded at start
set -eu
repo="${INFERPLANE_MODEL_REPOSITORY:-/models}"
models="${INFERPLANE_GROUP_MODELS:-}"
set -- --model-repository="$repo" --model-control-mode=explicit --disable-auto-complete-config \
  --model-load-thread-count=4 \
  --grpc-port=8001 --http-port=8000 --metrics-port=8002 --exit-on-error=false --strict-readiness=true
if [ "$models" = "*" ]; then
  set -- "$@" --load-model='*'
elif [ -n "$models" ]; then
  old_ifs="$IFS"; IFS=','
  for m in $models; do set -- "$@" --load-model="$m"; done
  IFS="$old_ifs"
fi
exec tritonserver "$@"
