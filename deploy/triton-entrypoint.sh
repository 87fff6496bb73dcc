#!/bin/sh
# Entrypoint of the Triton image (Dockerfile target `triton`): serve the model repository the init
# container synced into /models, loading this group's models in explicit model-control mode.
#   INFERPLANE_GROUP_MODELS  comma-separated model names, or * for every model in /models
set -eu
repo="${INFERPLANE_MODEL_REPOSITORY:-/models}"
models="${INFERPLANE_GROUP_MODELS:-*}"
set -- --model-repository="$repo" --model-control-mode=explicit --disable-auto-complete-config \
  --grpc-port=8001 --http-port=8000 --metrics-port=8002 --exit-on-error=false --strict-readiness=true
if [ "$models" = "*" ]; then
  set -- "$@" --load-model='*'
else
  old_ifs="$IFS"; IFS=','
  for m in $models; do set -- "$@" --load-model="$m"; done
  IFS="$old_ifs"
fi
exec tritonserver "$@"
