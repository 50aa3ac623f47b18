import glob
import os

# Building must not load the (possibly stale) extension through torch's backend autoload.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

# A second venv on the same torch wheel (the serving venv) reuses the extension the main
# install built in place, rather than compiling it again: TORCHNEURON_REUSE_EXT=1.
_REUSE = os.environ.get("TORCHNEURON_REUSE_EXT") == "1"
if _REUSE and not glob.glob("torch_neuronx/_C*.so"):
    raise SystemExit("TORCHNEURON_REUSE_EXT=1: torch_neuronx/_C*.so is not built; run `make setup` first")

setup(
    ext_modules=[] if _REUSE else [
        CppExtension(
            "torch_neuronx._C",
            sources=sorted(glob.glob("csrc/*/*.cpp")),
            # The Kineto plugin (csrc/profiler): torch's wheel ships Kineto's headers and was
            # built with USE_KINETO, which its profiler headers need to declare the registry.
            include_dirs=[os.path.join(os.path.dirname(torch.__file__), "include", "kineto")],
            define_macros=[("USE_KINETO", None)],
            # OpenMP: at::parallel_for in our kernels (the fused ones) must really run in
            # parallel, and mark the region so the ATen kernels inside it run serially.
            extra_compile_args=["-O2", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-flto=auto"],
            extra_link_args=["-fopenmp", "-flto=auto", "-O2", "-ffp-contract=off"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
