#!/usr/bin/env bash
# GPU check of fp8jax on one H100/H200: what the machine is, correctness, then timings.
#   OUT=/some/dir bash scripts/gpu_check_kernels.sh
#   STEPS="env pytest programs" OUT=/some/dir bash scripts/gpu_check_kernels.sh   # some steps
# Installs nothing and imports only what the GPU image has. Each step has its own
# time limit (all of them add up to 890 s) and saves its results as it goes:
#   $OUT/results.jsonl  one JSON line per measurement (fp8jax.bench.gpu_check)
#   $OUT/steps.txt      each step's exit status;  $OUT/pytest.txt, $OUT/<step>.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8jax_gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
status() { echo "$1: rc=$2" | tee -a "$OUT/steps.txt"; }
STEPS=${STEPS:-env pytest programs dense grouped moe_step quantizers}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS
  want "$1" || return 0
  timeout "$2" "$PY" -m fp8jax.bench.gpu_check "$1" --out "$OUT" >"$OUT/$1.log" 2>&1
  status "$1" $?
  tail -n 3 "$OUT/$1.log"
}

# env compiles and checks every Mosaic GPU quantizer variant and times them once
# against XLA's fusions (what "auto" takes): the longest of the short steps.
step env 150
# Correctness on the GPU: the compiled kernels against the float64 oracle; a
# kernel that fails its self-check on a Hopper GPU fails here (no skip).
if want pytest; then
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/test_kernels_block_gemm.py tests/test_kernels_grouped_block_gemm.py \
    tests/test_kernels_gpu_quantize.py >"$OUT/pytest.txt" 2>&1
  status pytest $?
  tail -n 3 "$OUT/pytest.txt"
fi
# The programs the compilers priced, timed, with every kernel's device time.
step programs 180
step dense 100
step grouped 60
step moe_step 130
step quantizers 120
cat "$OUT/steps.txt"
