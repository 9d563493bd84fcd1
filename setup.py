"""Builds minagi._C: the CPU kernels always, the GPU kernels when torch is a CUDA or ROCm build.

The GPU build is chosen from how torch was built (torch.version.cuda / torch.version.hip) and
whether its toolkit is found (CUDA_HOME / ROCM_HOME), never from whether a GPU is visible, so a
build machine without a GPU still builds GPU kernels. Environment:
  MINAGI_CPU_ONLY=1     skip the GPU sources even when torch and a toolkit could build them
  MINAGI_ARCHS=...      GPU architectures (else TORCH_CUDA_ARCH_LIST / PYTORCH_ROCM_ARCH)
  MINAGI_REQUIRE_EXT=1  a failed extension build fails the install (else minagi falls back to
                        its pure-torch ops and says so at import)
Install with `pip install --no-build-isolation -e .` so the build uses the torch you have.
"""
import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# Strix Halo (gfx1151) first: it is what the project is for; then RDNA3 and CDNA2/3.
DEFAULT_ROCM_ARCHS = "gfx1151;gfx1100;gfx90a;gfx942"


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _openmp_flags():
    """-fopenmp for compile and link: without it at::parallel_for silently runs on one thread."""
    if sys.platform == "win32":
        return ["/openmp"], []
    if sys.platform == "darwin":  # Apple clang has no OpenMP runtime by default
        return [], []
    return ["-fopenmp"], ["-fopenmp"]


def _gpu_flavour(torch, cpp_extension):
    if os.environ.get("MINAGI_CPU_ONLY") == "1" or not _sources("csrc/cuda/*.cu"):
        return None
    if getattr(torch.version, "hip", None) and cpp_extension.ROCM_HOME:
        return "rocm"
    if torch.version.cuda and cpp_extension.CUDA_HOME:
        return "cuda"
    return None


def _set_archs(flavour):
    archs = os.environ.get("MINAGI_ARCHS")
    if flavour == "rocm":
        os.environ["PYTORCH_ROCM_ARCH"] = archs or os.environ.get("PYTORCH_ROCM_ARCH") or DEFAULT_ROCM_ARCHS
    elif flavour == "cuda" and archs:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs


def _extensions():
    import torch
    from torch.utils import cpp_extension

    omp_compile, omp_link = _openmp_flags()
    # -fno-trapping-math: no floating-point trap is ever enabled here, and without it GCC will not
    # vectorise a loop whose float compares it would have to if-convert (GPT-OSS's clamps ran
    # scalar). Values are unchanged: NaN and infinities keep IEEE semantics.
    cxx = (["/O2", "/std:c++17"] if sys.platform == "win32" else ["-O3", "-fno-trapping-math"]) + omp_compile
    sources = _sources("csrc/ops.cpp") + _sources("csrc/cpu/*.cpp")
    flavour = _gpu_flavour(torch, cpp_extension)
    print(f"minagi setup: torch {torch.__version__}, GPU build: {flavour or 'none'}")
    if flavour is None:
        return [cpp_extension.CppExtension(
            "minagi._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=omp_link)]
    _set_archs(flavour)
    nvcc = ["-O3"] if flavour == "rocm" else ["-O3", "--expt-relaxed-constexpr"]
    return [cpp_extension.CUDAExtension(
        "minagi._C", sources + _sources("csrc/cuda/*.cu"),
        extra_compile_args={"cxx": cxx + ["-DMINAGI_WITH_GPU"], "nvcc": nvcc + ["-DMINAGI_WITH_GPU"]},
        extra_link_args=omp_link)]


def _build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        """A failed build leaves a working pure-torch install unless MINAGI_REQUIRE_EXT=1."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # the compiler's own output is above this line
                if os.environ.get("MINAGI_REQUIRE_EXT") == "1":
                    raise
                print(f"\nminagi setup: WARNING: building {ext.name} failed ({exc}); minagi will "
                      "run on its pure-torch ops. Set MINAGI_REQUIRE_EXT=1 to make this an error.\n",
                      file=sys.stderr)

        def copy_file(self, infile, outfile, *args, **kwargs):
            """A build in place (`--inplace`, `pip install -e .`) writes the compiled file beside
            its target and renames it over: a process that starts during a rebuild loads the old
            build or the new one. setuptools' own copy deletes the target first, and a process
            starting in that window found no extension and ran on the pure-torch ops, whose
            numerics differ in the last bits (a suspect of issue 34's divergent runs)."""
            if not str(outfile).endswith((".so", ".pyd")) or getattr(self, "dry_run", False):
                return super().copy_file(infile, outfile, *args, **kwargs)
            tmp = f"{outfile}.{os.getpid()}.tmp"
            try:
                shutil.copy2(infile, tmp)
                os.replace(tmp, outfile)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return outfile, True

    return Build


setup(ext_modules=_extensions(), cmdclass={"build_ext": _build_ext_class()})
