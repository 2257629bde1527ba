#!/usr/bin/env bash
# The benchmark sweep on one NVIDIA Hopper GPU (H100/H200).
#
#   OUT=/some/dir bash scripts/gpu_sweep.sh        # ~7 min wall, everything under $OUT
#
# Installs nothing (the GPU machine has no package registry): it runs from the
# checkout with PYTHONPATH set, and refuses where JAX has no GPU backend.  Then:
#   1. GEMM sweep on DeepSeek-V3 shapes (M=4096, K=7168, N=2112/24576/4096/7168) and
#      the MoE expert shapes: every recipe x impl (xla with f32/bf16 dequant, pallas
#      where usable) + the canonical xla_fp8_per_tensor reference, fwd and fwd+bwd.
#      The first shape's compiled HLO is saved (bench_gpu/hlo/) to audit the
#      __cublas$lt$matmul$f8 check (column cublaslt_fp8 = found / not found) and
#      the dot algorithm of every GEMM (column dot_algorithms).
#   2. Squares 1024-8192 for the main recipes.
#   3. MoE train step of ModelConfig.small() for the main recipes.
# Each part has a time budget (cases past it are recorded as "skipped") and a
# hard timeout; the whole script stays under ~6.5 min plus JAX start-up.
# Results to keep go under experiments/results/bench_gpu*/ ({results.json,
# results.csv,*.png,run.log}); the speedup tables are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fp8jax_gpu_sweep}"
mkdir -p "$OUT/bench_gpu" "$OUT/bench_gpu_moe"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The GPU image's Python is python3 and has no ml_collections: experiments/bench.py
# then reads configs/bench/sweep.py and its --config.* flags itself
# (fp8jax.bench.config_file), so nothing needs to be carried or installed.
PY=${PYTHON:-python3}
"$PY" -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/bench_gpu/devices.txt"
nvidia-smi > "$OUT/bench_gpu/nvidia-smi.txt" 2>&1 || true
if [[ "${SMOKE:-0}" != 1 ]] && ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "JAX has no GPU backend here: refusing to run the GPU sweep (use SMOKE=1 for a CPU check)"; exit 2
fi

export MPLBACKEND=Agg
# SMOKE=1: the same three parts at tiny sizes (checks this script's plumbing on a CPU).
if [[ "${SMOKE:-0}" == 1 ]]; then
  P1="--config.shapes=64x256x128"; P2="--config.square_sizes=128"
  P3="--config.moe_preset=tiny --config.moe_batch=2 --config.moe_seq=16 --config.recipes=bf16"
else
  P1="--config.groups=dsv3,moe --config.m_tokens=4096"; P2="--config.square_sizes=1024,2048,4096,8192"
  P3="--config.moe_preset=small --config.moe_batch=8 --config.recipes=bf16,deepseek_v3,current_tensor,hybrid_delayed"
fi
start=$(date +%s)
# 1. DeepSeek-V3 + MoE expert shapes, every recipe x impl, both passes (~4 min).
timeout 300 "$PY" experiments/bench.py --config=configs/bench/sweep.py \
  --out_dir="$OUT/bench_gpu" $P1 \
  --config.warmup=3 --config.iters=20 --config.time_budget_s=240 --config.moe_step=false --config.dump_hlo=true \
  2>&1 | tee "$OUT/bench_gpu/run.log" | grep -v "^[IW][0-9]" || echo "GEMM sweep failed/timed out"
# 2. Squares 1024-8192: the main recipes, bf16 dequant, + the reference (~1.5 min).
mkdir -p "$OUT/bench_gpu_square"
timeout 130 "$PY" experiments/bench.py --config=configs/bench/sweep.py \
  --out_dir="$OUT/bench_gpu_square" --config.groups=square $P2 \
  --config.recipes=bf16,deepseek_v3,current_tensor,hybrid_delayed --config.dequant_dtypes=bfloat16 \
  --config.warmup=3 --config.iters=20 --config.time_budget_s=90 --config.moe_step=false \
  2>&1 | tee "$OUT/bench_gpu_square/run.log" | grep -v "^[IW][0-9]" || echo "square sweep failed/timed out"
# 3. MoE train step, ModelConfig.small(), main recipes (~1.5 min).
timeout 130 "$PY" experiments/bench.py --config=configs/bench/sweep.py \
  --out_dir="$OUT/bench_gpu_moe" --config.groups= --config.moe_step=true $P3 --config.warmup=2 --config.time_budget_s=90 \
  2>&1 | tee "$OUT/bench_gpu_moe/run.log" | grep -v "^[IW][0-9]" || echo "MoE step run failed/timed out"
echo "gpu_sweep.sh done in $(( $(date +%s) - start )) s; outputs in $OUT"
