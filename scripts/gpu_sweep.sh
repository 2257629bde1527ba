#!/usr/bin/env bash
# GPU part of the benchmark sweep (issue 6, item 3), for one NVIDIA Hopper GPU (H100/H200).
#
#   OUT=/some/dir bash scripts/gpu_sweep.sh        # ~7 min wall, everything under $OUT
#
# Installs nothing beyond `pip install -e .` (if fp8jax is not importable) and
# jax[cuda12] (only if JAX has no GPU backend).  Then:
#   1. GEMM sweep: DeepSeek-V3 shapes (M=4096, K=7168, N=2112/24576/4096/7168), MoE
#      expert shapes, squares 1024-8192; every recipe x impl (xla with f32/bf16
#      dequant, pallas where usable) + the canonical xla_fp8_per_tensor reference;
#      fwd and fwd+bwd; cases past a 330 s budget are recorded as skipped.
#      The first shape's compiled HLO is saved (hlo/) to audit the
#      __cublas$lt$matmul$f8 check (column cublaslt_fp8 = found / not found).
#   2. MoE train step of ModelConfig.small() for the main recipes (120 s budget).
# Commit $OUT/bench_gpu/{results.json,results.csv,*.png,run.log} as
# experiments/results/bench_gpu/ and quote the speedup table printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/experiments/results/bench_gpu_run}"
mkdir -p "$OUT/bench_gpu" "$OUT/bench_gpu_moe"

python -c "import fp8jax.bench" 2>/dev/null || pip install -q -e .
if ! python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  pip install -q "jax[cuda12]"
fi
python -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/bench_gpu/devices.txt"
nvidia-smi > "$OUT/bench_gpu/nvidia-smi.txt" 2>&1 || true

export MPLBACKEND=Agg
start=$(date +%s)
timeout 420 python experiments/bench_sweep.py \
  --out_dir="$OUT/bench_gpu" --groups=dsv3,moe,square --m_tokens=4096 \
  --warmup=3 --iters=20 --time_budget_s=330 --moe_step=false --dump_hlo \
  2>&1 | tee "$OUT/bench_gpu/run.log" | grep -v "^[IW][0-9]"
timeout 160 python experiments/bench_sweep.py \
  --out_dir="$OUT/bench_gpu_moe" --groups= --moe_step --moe_preset=small --moe_batch=8 \
  --recipes=bf16,deepseek_v3,current_tensor,hybrid_delayed --warmup=2 --time_budget_s=120 \
  2>&1 | tee "$OUT/bench_gpu_moe/run.log" | grep -v "^[IW][0-9]" || echo "MoE step run failed/timed out"
echo "gpu_sweep.sh done in $(( $(date +%s) - start )) s; outputs in $OUT"
