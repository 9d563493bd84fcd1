"""Builds minagi._C: the CPU kernels always, the GPU kernels when torch is a CUDA or ROCm build.

The GPU build is chosen from how torch was built (torch.version.cuda / torch.version.hip) and
whether its toolkit is found (CUDA_HOME / ROCM_HOME), never from whether a GPU is visible, so a
build machine without a GPU still builds GPU kernels. Environment:
  MINAGI_CPU_ONLY=1     skip the GPU sources even when torch and a toolkit could build them
  MINAGI_ARCHS=...      GPU architectures (else TORCH_CUDA_ARCH_LIST / PYTORCH_ROCM_ARCH)
  MINAGI_REQUIRE_EXT=1  a failed extension build fails the install (else minagi falls back to
                        its pure-torch ops and says so at import)
  MINAGI_REBUILD=1      compile even where build/minagi-ext-cache holds a build of these sources
Install with `pip install --no-build-isolation -e .` so the build uses the torch you have.

A build is kept in build/minagi-ext-cache/KEY/, KEY a digest of what made it (every file under
csrc/, this file, torch's version, the compiler, the Python ABI, the environment that changes the
flags): a later install of the same sources, such as `pip install --no-build-isolation -e
".[hf]"` to add an extra (pip builds an editable install afresh in a temporary folder), copies it
instead of compiling again. While it compiles, each file ninja finishes is named on the terminal
(/dev/tty: pip shows a build's own output only with -v), "[3/10] compiled csrc/cpu/decode.cpp".
"""
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# Strix Halo (gfx1151) first: it is what the project is for; then RDNA3 and CDNA2/3.
DEFAULT_ROCM_ARCHS = "gfx1151;gfx1100;gfx90a;gfx942"
CACHE = os.path.join("build", "minagi-ext-cache")  # under the project folder
CACHE_KEEP = 3  # builds kept (the newest)
# The environment that changes what the compiler makes, besides the sources.
BUILD_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "DEBUG", "MINAGI_CPU_ONLY", "MINAGI_ARCHS",
             "TORCH_CUDA_ARCH_LIST", "PYTORCH_ROCM_ARCH", "CUDA_HOME", "ROCM_HOME", "NVCC_APPEND_FLAGS")


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


def _ninja_on_path():
    """The running Python's own ninja (the README installs the ninja package into the venv) on
    PATH: `.venv/bin/pip install` without an activated venv does not put .venv/bin there, and
    torch then builds one file at a time without ninja (and without its [n/m] progress)."""
    here = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=here):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def _extensions():
    import torch
    from torch.utils import cpp_extension

    _ninja_on_path()

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


def _cache_key(root, inputs):
    """The digest a build is kept under: every file under root/csrc (its path and bytes; hidden
    files left out) and root/setup.py, and `inputs` (what else made the build: see _build_inputs)."""
    h = hashlib.sha256()
    names = [os.path.join(root, "setup.py")]
    for folder, dirs, files in os.walk(os.path.join(root, "csrc")):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        names += [os.path.join(folder, f) for f in files if not f.startswith(".")]
    for name in sorted(os.path.relpath(n, root).replace(os.sep, "/") for n in names):
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    h.update(json.dumps(inputs, sort_keys=True).encode())
    return h.hexdigest()[:20]


def _compiler_id(command):
    """The compiler's first --version line ("" where it cannot say)."""
    try:
        out = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0] if out else ""


def _build_inputs(ext):
    """What a build depends on besides the files: torch (version, commit, GPU toolkits, C++
    ABI), Python's ABI and the platform, the compiler, the extension's sources and flags, and
    the environment in BUILD_ENV."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    return {
        "torch": [torch.__version__, getattr(torch.version, "git_version", ""), torch.version.cuda,
                  getattr(torch.version, "hip", None), bool(torch._C._GLIBCXX_USE_CXX11_ABI)],
        "python": [sysconfig.get_config_var("EXT_SUFFIX"), sys.version, sys.platform],
        "toolkits": [cpp_extension.CUDA_HOME, cpp_extension.ROCM_HOME],
        "compiler": _compiler_id(os.environ.get("CXX", "c++")),
        "extension": [ext.name, list(ext.sources), ext.extra_compile_args, ext.extra_link_args],
        "env": {k: os.environ[k] for k in BUILD_ENV if k in os.environ},
    }


def _keep_build(built, cached):
    """A finished build copied into the cache (renamed into place whole), and the cache cut to
    its CACHE_KEEP newest builds."""
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    tmp = f"{cached}.{os.getpid()}.tmp"
    shutil.copy2(built, tmp)
    os.replace(tmp, cached)
    os.utime(os.path.dirname(cached))
    root = os.path.dirname(os.path.dirname(cached))
    builds = sorted((os.path.join(root, d) for d in os.listdir(root)), key=os.path.getmtime, reverse=True)
    for old in builds[CACHE_KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def _terminal():
    """The terminal to name each compiled file on, where the build's own output is not one (pip
    captures it): /dev/tty, when this process is in the terminal's foreground; else None."""
    if os.name != "posix" or os.isatty(1) or os.environ.get("MINAGI_BUILD_QUIET") == "1":
        return None
    try:
        fd = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if os.tcgetpgrp(fd) == os.getpgrp():
            return os.fdopen(fd, "w", buffering=1)
    except OSError:
        pass
    os.close(fd)
    return None


NINJA_LINE = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")


def progress_line(line, root, elapsed):
    """ninja's line for a finished step, "[3/10] c++ ... -c /path/csrc/cpu/decode.cpp -o ...", in
    a few words: "[3/10] compiled csrc/cpu/decode.cpp (1m12s)"; None for any other line."""
    m = NINJA_LINE.match(line.strip())
    if not m:
        return None
    sources = re.findall(r"\s(\S+\.(?:cpp|cc|c|cu|hip))(?=\s|$)", m.group(3))
    if sources:
        src = sources[-1]
        what = "compiled " + (os.path.relpath(src, root) if os.path.isabs(src) else src)
    else:
        out = re.search(r"\s-o\s+(\S+)", m.group(3))
        what = "linked " + os.path.basename(out.group(1)) if out else m.group(3).split()[0]
    return f"[{m.group(1)}/{m.group(2)}] {what} ({int(elapsed) // 60}m{int(elapsed) % 60:02d}s)"


class _Progress:
    """While the compiler runs: everything written to stdout (ninja's lines, the compiler's)
    passes through as before, and each step ninja finishes is also named in one short line on
    the terminal (_terminal), where pip would hide it."""

    def __init__(self, root):
        self.root, self.tty, self.t0 = root, _terminal(), time.monotonic()

    def say(self, text, last=False):
        """One line on the terminal (where there is one); last: the terminal is then let go."""
        if self.tty is not None:
            try:
                self.tty.write(f"\rminagi build: {text}\n")
            except OSError:
                pass
            if last:
                self.tty.close()
                self.tty = None

    def __enter__(self):
        if self.tty is None:
            return self
        sys.stdout.flush()
        self.saved = os.dup(1)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()
        return self

    def _pump(self, read):
        with os.fdopen(read, "rb") as pipe:
            for raw in pipe:
                short = progress_line(raw.decode(errors="replace"), self.root, time.monotonic() - self.t0)
                while raw:
                    raw = raw[os.write(self.saved, raw):]
                if short:
                    self.say(short)

    def __exit__(self, *exc):
        if self.tty is None:
            return
        sys.stdout.flush()
        os.dup2(self.saved, 1)  # the pipe's last writer closed: the pump reads to its end
        self.thread.join()
        os.close(self.saved)
        elapsed = int(time.monotonic() - self.t0)
        self.say(f"{'failed' if exc[0] else 'done'} after {elapsed // 60}m{elapsed % 60:02d}s", last=True)


def _build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        """A build of the same sources is copied from the cache instead of compiled; the files
        compiled are named on the terminal; a failed build leaves a working pure-torch install
        unless MINAGI_REQUIRE_EXT=1."""

        def build_extension(self, ext):
            target = self.get_ext_fullpath(ext.name)
            cached = os.path.join(ROOT, CACHE, _cache_key(ROOT, _build_inputs(ext)), os.path.basename(target))
            if os.environ.get("MINAGI_REBUILD") != "1" and os.path.isfile(cached):
                os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                self.copy_file(cached, target)
                line = (f"{ext.name} was built from these sources before: copied from "
                        f"{os.path.relpath(cached, ROOT)}, nothing compiled (MINAGI_REBUILD=1 compiles)")
                print(f"minagi setup: {line}", flush=True)
                _Progress(ROOT).say(line, last=True)
                return
            progress = _Progress(ROOT)
            progress.say(f"compiling {ext.name} ({len(ext.sources)} files, then a link; "
                         f"MAX_JOBS={os.environ.get('MAX_JOBS', 'unset')}): a file a line as each finishes")
            if not getattr(self, "use_ninja", True):  # torch's one-file-at-a-time build: each file named too
                self._name_each_file(progress, len(ext.sources))
            try:
                with progress:
                    super().build_extension(ext)
            except Exception as exc:  # the compiler's own output is above this line
                if os.environ.get("MINAGI_REQUIRE_EXT") == "1":
                    raise
                print(f"\nminagi setup: WARNING: building {ext.name} failed ({exc}); minagi will "
                      "run on its pure-torch ops. Set MINAGI_REQUIRE_EXT=1 to make this an error.\n",
                      file=sys.stderr)
                return
            if os.path.isfile(target):
                try:
                    _keep_build(target, cached)
                except OSError as exc:  # a read-only tree: the build stands, uncached
                    print(f"minagi setup: could not keep the build in {CACHE} ({exc})", file=sys.stderr)

        def _name_each_file(self, progress, total):
            compile_one, done = self.compiler._compile, []

            def named(obj, src, *args, **kwargs):
                compile_one(obj, src, *args, **kwargs)
                done.append(src)
                progress.say(progress_line(f"[{len(done)}/{total}] c++ -c {src}", ROOT, time.monotonic() - progress.t0))

            self.compiler._compile = named

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
