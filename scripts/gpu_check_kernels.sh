#!/usr/bin/env bash
# GPU check of the block-scaled FP8 Pallas kernels (fp8jax/kernels), < 8 min on one H100/H200.
#   OUT=/some/dir bash scripts/gpu_check_kernels.sh
# 1. environment (nvidia-smi, jax devices), 2. GPU correctness tests vs the float64 oracle,
# 3. PTX of the kernel: does it use FP8 wgmma?, 4. the benchmark (+ Triton parameter sweep).
# Everything lands in $OUT; a failing step is recorded and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8jax_gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status() { echo "$1: rc=$2" | tee -a "$OUT/steps.txt"; }

{ nvidia-smi; python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__); print(jax.devices()); d=jax.devices()[0]; print(d.device_kind, getattr(d,'compute_capability',None))"; } \
  >"$OUT/env.txt" 2>&1
status env $?
if ! python3 -c "import jax,sys; sys.exit(jax.default_backend()!='gpu')" 2>>"$OUT/env.txt"; then
  echo "no GPU backend in this jax install (see env.txt); stopping" | tee -a "$OUT/steps.txt"
  exit 1
fi
python3 -c "from fp8jax.kernels import dispatch; print('kernel_available', dispatch.kernel_available())" \
  >"$OUT/kernel_available.txt" 2>&1
status kernel_available $?

# 2. correctness on the GPU (interpret-mode tests too: they are quick and catch a broken environment)
timeout 180 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" -rs \
  tests/test_kernels_block_gemm.py tests/test_kernels_grouped_block_gemm.py >"$OUT/pytest.txt" 2>&1
status pytest $?

# 3. does the compiled kernel issue FP8 wgmma? (PTX from the XLA dump of one 1024^3 call)
rm -rf "$OUT/dump"
XLA_FLAGS="--xla_dump_to=$OUT/dump" timeout 90 python3 - >"$OUT/ptx_check.txt" 2>&1 <<'PY'
import jax, jax.numpy as jnp
from fp8jax.bench.kernel import make_operands
from fp8jax.kernels import block_gemm as bg
a, sa, b, sb = make_operands(jax.random.key(0), 1024, 1024, 1024)
jax.block_until_ready(bg.block_scaled_matmul_nt(a, sa, b.T, sb.T, interpret=False))
jax.block_until_ready(bg.block_scaled_matmul(a, sa, b, sb, interpret=False))
PY
status ptx_dump $?
{ echo "wgmma instructions in the dumped PTX (want ...e4m3.e4m3):";
  grep -rhoE "wgmma\.mma_async[.a-z0-9_]*" "$OUT/dump" 2>/dev/null | sort | uniq -c;
  echo "mma.sync (non-wgmma) instructions:"; grep -rhoE "mma\.sync[.a-z0-9_]*" "$OUT/dump" 2>/dev/null | sort | uniq -c;
  echo "cvt from e4m3 (would mean FP8 upcast before the MMA):"; grep -rhoE "cvt[.a-z0-9_]*e4m3[.a-z0-9_]*" "$OUT/dump" 2>/dev/null | sort | uniq -c; } >>"$OUT/ptx_check.txt"
rm -rf "$OUT/dump"

# 4. benchmark (JSON + table) and a small Triton launch-parameter sweep at 4096^3
timeout 300 python3 experiments/bench_gemm.py --out "$OUT/bench_gemm.json" --sweep >"$OUT/bench.txt" 2>&1
status bench $?
cat "$OUT/steps.txt"
