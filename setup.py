import glob
import os

# Building must not load the (possibly stale) extension through torch's backend autoload.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

setup(
    ext_modules=[
        CppExtension(
            "torch_neuronx._C",
            sources=sorted(glob.glob("csrc/*/*.cpp")),
            # OpenMP: at::parallel_for in our kernels (the fused ones) must really run in
            # parallel, and mark the region so the ATen kernels inside it run serially.
            extra_compile_args=["-O2", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-flto=auto"],
            extra_link_args=["-fopenmp", "-flto=auto", "-O2", "-ffp-contract=off"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
