"""The precision and hardware toolkit, beside the training core.

* :mod:`~fp8jax.toolkit.catalog`: number formats (bits, range, precision);
* :mod:`~fp8jax.toolkit.hardware`: accelerators and what each runs natively
  (``data/accelerators.csv``, every figure with its source);
* :mod:`~fp8jax.toolkit.planner`: memory, cards and nodes of a deployment;
* :mod:`~fp8jax.toolkit.convert`: FP8 (DeepSeek-V3 layout) <-> BF16 checkpoints;
* :mod:`~fp8jax.toolkit.quant_error`: what each recipe's quantization does to a tensor;
* :mod:`~fp8jax.toolkit.cli`: the ``fp8jax`` console script.

Nothing in the training core imports this package.
"""
