"""Builds dtp_kernels._C: the C++ CPU kernels always, the CUDA kernels when they can be.

CUDA sources (csrc/*.cu) are compiled when torch is a CUDA build and nvcc is found, or
when DTP_BUILD_CUDA=1; DTP_BUILD_CUDA=0 turns them off. TORCH_CUDA_ARCH_LIST defaults to
"8.0;9.0". Without a C++ compiler, or with DTP_BUILD_EXTENSION=0, the package is pure
Python: the reference, torch and (on CUDA) triton backends, without the compiled ones.
Build in place with `python setup.py build_ext --inplace` (what `make` does), make a
wheel with `pip wheel --no-build-isolation --no-deps .`, or install with
`pip install --no-build-isolation .`.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sysconfig

import torch
from setuptools import find_packages, setup

# torch guesses CUDA_HOME=/usr/local from the nvcc wrapper on PATH; name the toolkit.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

DEFAULT_ARCH_LIST = "8.0;9.0"


def find_nvcc() -> str | None:
    """Path of nvcc under CUDA_HOME, /usr/local/cuda or on PATH; None when absent."""
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for root in candidates:
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


def want_cuda(cuda_sources: list[str]) -> bool:
    """Whether to compile the CUDA sources, from DTP_BUILD_CUDA or from what is present."""
    forced = os.environ.get("DTP_BUILD_CUDA")
    if forced not in (None, "", "0", "1"):
        raise SystemExit(f"DTP_BUILD_CUDA must be 0 or 1, got {forced!r}")
    if forced == "0" or not cuda_sources:
        if forced == "1":
            raise SystemExit("DTP_BUILD_CUDA=1 but csrc/ has no CUDA sources")
        return False
    found = torch.version.cuda is not None and find_nvcc() is not None
    if forced == "1" and not found:
        raise SystemExit(
            "DTP_BUILD_CUDA=1 needs a CUDA build of torch and nvcc "
            f"(torch.version.cuda={torch.version.cuda}, nvcc={find_nvcc()})"
        )
    return found


def cuda_library_headers() -> list[str]:
    """Headers of the CUDA libraries (cuSPARSE, cuBLAS, ...) that ATen's CUDA headers
    include; pip's CUDA builds of torch ship them in site-packages/nvidia/cu*/include."""
    import site

    roots = [*site.getsitepackages(), os.path.dirname(os.path.dirname(torch.__file__))]
    found = []
    for root in dict.fromkeys(roots):
        found += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "include")))
    return found


def want_extension() -> bool:
    """Whether to compile dtp_kernels._C: DTP_BUILD_EXTENSION=0|1, else when a C++
    compiler is found."""
    forced = os.environ.get("DTP_BUILD_EXTENSION")
    if forced not in (None, "", "0", "1"):
        raise SystemExit(f"DTP_BUILD_EXTENSION must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False
    compiler = os.environ.get("CXX") or (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(compiler) is None:
        if forced == "1":
            raise SystemExit(f"DTP_BUILD_EXTENSION=1 but no C++ compiler ({compiler!r})")
        print(f"dtp-kernels: no C++ compiler ({compiler!r}): building the pure-Python package")
        return False
    return True


def extensions() -> list:
    if not want_extension():
        return []
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    # -fno-trapping-math and -fno-math-errno let the loops with floor() and selects
    # vectorise; unlike -ffast-math they keep NaN and Inf, which the state guard needs.
    cxx = [
        "-O3",
        "-std=c++20",
        "-fno-trapping-math",
        "-fno-math-errno",
        "-fopenmp",  # at::parallel_for is header code: without OpenMP it runs serially
        f'-DDTP_TORCH_VERSION="{torch.__version__}"',
    ]
    link = ["-fopenmp"]
    # What the build saw, compiled into build_info() so the tests check the build's own
    # decision, not the environment they happen to run in.
    toolchain = torch.version.cuda is not None and find_nvcc() is not None
    forced = os.environ.get("DTP_BUILD_CUDA") or "auto"
    cxx += [f"-DDTP_CUDA_TOOLCHAIN_FOUND={int(toolchain)}", f'-DDTP_BUILD_CUDA_SETTING="{forced}"']
    if not want_cuda(cuda_sources):
        return [
            CppExtension(
                "dtp_kernels._C",
                cpp_sources,
                extra_compile_args={"cxx": cxx},
                extra_link_args=link,
            )
        ]
    nvcc = find_nvcc()
    os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(nvcc)))
    arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    flags = ["-DDTP_WITH_CUDA", f'-DDTP_CUDA_ARCH_LIST="{arch_list}"']
    return [
        CUDAExtension(
            "dtp_kernels._C",
            cpp_sources + cuda_sources,
            include_dirs=cuda_library_headers(),
            extra_compile_args={
                "cxx": cxx + flags,
                "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", *flags],
            },
            extra_link_args=link,
        )
    ]


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def version() -> str:
    return re.search(r'__version__ = "([^"]+)"', read("dtp_kernels/_version.py")).group(1)


EXTRAS = {
    # the command line and its data, training, logs and plots
    "pipeline": [
        "pyyaml",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "scikit-learn",
        "torchvision",
        "safetensors",  # model.weights files as the Hugging Face Hub and timm ship them
    ],
    # transformers, timm models, Trainer and Lightning callbacks, builder files
    "transformers": ["transformers", "timm", "safetensors", "accelerate"],
    "lightning": ["lightning"],
    "dev": ["pytest", "pytest-benchmark", "hypothesis", "ruff", "clang-format"],
}
EXTRAS["all"] = sorted({p for ps in EXTRAS.values() for p in ps})

setup(
    name="dtp-kernels",
    version=version(),
    description="Differentiable Transportation Pruning: fused kernels, reference and pruner",
    long_description=read("README.md"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["dtp_kernels", "dtp_kernels.*"]),
    package_data={"dtp_kernels": ["py.typed", "_C.pyi", "configs/*.yaml", "configs/paper/*.yaml"]},
    python_requires=">=3.11",
    install_requires=["torch>=2.11", "torch-pruning", "numpy"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["dtp = dtp_kernels.cli:main"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
