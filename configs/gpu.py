r"""GPU-sized run: ModelConfig.gpu_1b (~1B parameters) with a byte vocabulary.

Command (one NVIDIA GPU with FP8 support, `pip install -e ".[gpu]"`):
  python experiments/train.py --config=configs/gpu.py --workdir=/tmp/fp8jax_gpu

What it prints: progress lines every 10 steps with steps/s, tokens/s and the
ETA for 5,000 steps of 32 x 2048 bytes (4 microbatches of 8).  Not run on CPU
(the first step alone would take hours there).
"""

from fp8jax.train.defaults import gpu_config


def get_config():
    return gpu_config()
