#!/usr/bin/env bash
# Installs a pinned lock into a venv with the resolver off, as `pip install --no-deps -r LOCK` does, by uv
# (tens of times faster on these machines; `make test` installs five such locks).
# Usage: tools/install-lock.sh PYTHON LOCK
#   PYTHON: the venv's interpreter; LOCK: a requirements file of == pins (requirements/*.txt).
# uv comes from .venv-uv (requirements/uv.txt, created here on first use). uv does not read pip's
# configuration, so pip's find-links (where these machines keep torch 2.13.0+cpu, which PyPI does not have)
# are passed on. If uv cannot be set up or fails, pip installs the lock instead, saying so: the same pins.
set -euo pipefail
PY="${1:?usage: tools/install-lock.sh PYTHON LOCK}"
LOCK="${2:?usage: tools/install-lock.sh PYTHON LOCK}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
UV_VENV="$ROOT/.venv-uv"
UV="$UV_VENV/bin/uv"

if [ ! -x "$UV" ]; then
  { python3.11 -m venv "$UV_VENV" \
    && "$UV_VENV/bin/python" -m pip --disable-pip-version-check -q install --no-deps -r "$ROOT/requirements/uv.txt"; } \
    || echo "[install-lock] could not install uv into $UV_VENV; pip installs the locks" >&2
fi

if [ -x "$UV" ]; then
  FIND_LINKS="${PIP_FIND_LINKS:-$(python3.11 -m pip config get global.find-links 2>/dev/null || true)}"
  args=()
  for dir in $FIND_LINKS; do args+=(--find-links "$dir"); done
  # --compile-bytecode: pip writes .pyc files at install and uv does not; without them every process vLLM
  # spawns (run with -B, so it never writes them) compiles vLLM and torch anew, which doubled the time of
  # the end-to-end servers' start-up.
  if "$UV" pip install -q --python "$PY" --no-deps --compile-bytecode "${args[@]}" -r "$LOCK"; then
    exit 0
  fi
  echo "[install-lock] uv failed on $LOCK; pip installs it" >&2
fi
"$PY" -m pip --disable-pip-version-check -q install --no-deps -r "$LOCK"
