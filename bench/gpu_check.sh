#!/usr/bin/env bash
# The prepared GPU check (see bench/gpu/gpu_check.py's docstring for what it does).
#
#   bash bench/gpu_check.sh --out "$OUT"                # on the GPU machine (< 8 minutes)
#   bash bench/gpu_check.sh --dry-run --out /tmp/gpu_dry  # here, on CPU (interpret mode)
#
# When .whl/ holds wheels (bench/gpu_wheels.sh) and python3 is 3.12 (what they are built for),
# they are installed offline into /tmp/site first; jax/flax/... always come from the image.
# Every argument is passed on to bench/gpu/gpu_check.py. Environment: GPU_CHECK_TIMEOUT (seconds
# for gpu_check.py, default 405 on GPU, 1800 dry), NO_WHEELS=1 (skip the wheel install).
# Then the quantized-base stage, bench/gpu/gpu_quant.py (its own budget: GPU_QUANT_TIMEOUT, default
# 90 on GPU, 900 dry; QUANT=0 skips it): the Mosaic GPU kernels over ggml blocks, numerics and
# speed vs the dequantized bf16 GEMM, into kernel_gpu.json ("quant") and one summary.txt line.
# Output (8 files): $OUT/{env.json,kernel_gpu.json,attention_gpu.json,serve_gpu.json,
# report.md,server.log,summary.txt,log.txt}. Exit status: 0 only if every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

OUT=""
DRY=0
prev=""
for a in "$@"; do
  [ "$prev" = "--out" ] && OUT=$a
  case "$a" in
    --out=*) OUT=${a#--out=} ;;
    --dry-run) DRY=1 ;;
  esac
  prev=$a
done
if [ -z "$OUT" ]; then
  OUT=$([ $DRY = 1 ] && echo /tmp/gpu_dry || echo /tmp/gpu_check)
  set -- "$@" --out "$OUT"
fi
mkdir -p "$OUT"
: > "$OUT/log.txt"
exec > >(tee -a "$OUT/log.txt") 2>&1

T0=$(date +%s)
echo "== gpu_check.sh $(date -u +%FT%TZ) in $REPO, out $OUT, dry run $DRY"
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}  # the server shares the GPU
export PYTHONUNBUFFERED=1
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}

PYVER=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if compgen -G ".whl/*.whl" > /dev/null && [ "${NO_WHEELS:-0}" != 1 ] && [ "$PYVER" = 3.12 ]; then
  echo "== installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=/tmp/site:$PWD
  else
    echo "!!! STAGE wheels FAILED: pip install --no-index .whl/*.whl; going on with what is installed"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
else
  if compgen -G ".whl/*.whl" > /dev/null; then
    echo "== not installing .whl/ (python $PYVER, the wheels are for 3.12, or NO_WHEELS=1)"
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

echo "== imports"
python3 - <<'PY' || echo "!!! STAGE imports FAILED (see above): the stages that need them will fail"
import importlib, sys
bad = []
for m in ("jax", "numpy", "flax", "safetensors", "tokenizers", "gguf", "jinja2", "aiohttp",
          "prometheus_client", "llguidance", "tqdm", "bitdelta_jax", "pallas_kernels",
          "serving"):
  try:
    importlib.import_module(m)
  except Exception as e:  # noqa: BLE001
    bad.append(f"{m}: {type(e).__name__}: {e}")
print("python", sys.version.split()[0], "| import failures:", bad or "none")
sys.exit(1 if bad else 0)
PY

LIMIT=${GPU_CHECK_TIMEOUT:-$([ $DRY = 1 ] && echo 1800 || echo 405)}
timeout -k 15 "$LIMIT" python3 -m bench.gpu.gpu_check "$@"
rc=$?
if [ $rc = 124 ] || [ $rc = 137 ]; then
  echo "!!! gpu_check.py was stopped by the ${LIMIT}s timeout: the summary below has the stages that finished"
  cat "$OUT/summary.txt" 2>/dev/null
fi
if [ "${QUANT:-1}" != 0 ]; then
  QLIMIT=${GPU_QUANT_TIMEOUT:-$([ $DRY = 1 ] && echo 900 || echo 90)}
  echo "== stage quant_gpu: bench/gpu/gpu_quant.py (${QLIMIT}s)"
  timeout -k 10 "$QLIMIT" python3 -m bench.gpu.gpu_quant "$@"
  qrc=$?
  if [ $qrc != 0 ]; then
    echo "!!! STAGE quant_gpu FAILED (exit $qrc$([ $qrc = 124 ] && echo ", the ${QLIMIT}s timeout"))"
    [ $rc = 0 ] && rc=$qrc
  fi
fi
echo "== gpu_check.sh done in $(( $(date +%s) - T0 ))s, exit $rc; files in $OUT:"
ls -la "$OUT"
exit $rc
