r"""The monitors' example plot: three tiny runs below 8 bits, loss and the FFN monitors.

Commands (train the three runs, then plot them):
  for r in mxfp8 mxfp8_ceil nvfp4; do python experiments/train.py --config=configs/tiny.py --config.recipe=$r --config.steps=60 --config.log_every=5 --workdir=/tmp/monitors_ex_$r; done
  python experiments/study.py --config=configs/study/monitors_example.py --run=/tmp/monitors_ex_mxfp8,/tmp/monitors_ex_mxfp8_ceil,/tmp/monitors_ex_nvfp4 --out_dir=experiments/results/monitors

What it prints: "wrote DIR/telemetry_example.png": the panels loss, saturated,
flushed, amax_growth, outlier_ratio, align_max and noise_ratio of the model
and the FFN sites (SwiGLU, w2's input and gradient), one colour per run
(experiments/results/monitors/README.md reads it).  Logic:
fp8jax.numerics.studies.plot_telemetry.
"""

from pathlib import Path

from fp8jax.train.defaults import config_file


def get_config():
    c = config_file(Path(__file__).parent / "plot_telemetry.py")
    c.png = "telemetry_example.png"
    c.stats = "loss,saturated,flushed,amax_growth,outlier_ratio,align_max,noise_ratio"
    c.sites = r"^model$|swiglu|w2/x|w2/dy"
    c.labels = "mxfp8,mxfp8_ceil,nvfp4"
    return c
