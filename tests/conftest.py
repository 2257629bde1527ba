import glob
import os
import sys

# Tests import the independent reference as `reference`.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("MPLBACKEND", "Agg")

# libtpu (installed to compile TPU programs for a topology on this machine) makes
# every process probe for a TPU at start-up; where there is none, run on the CPU
# and let parallel test workers load libtpu side by side.
if "JAX_PLATFORMS" not in os.environ:
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None and not glob.glob("/dev/accel*"):
        os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# JAX's CUDA plugin, where installed, compiles programs for a described GPU
# (fp8jax.bench.mgpu_ir); without a GPU its CUDA library version check would
# keep it from registering, so skip the check where no NVIDIA device exists.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
