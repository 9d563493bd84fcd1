#!/usr/bin/env bash
# Compile the GPU kernels (csrc/cuda/*_kernels.cuh) with their launches (tools/rocm_check/*.cpp,
# one translation unit per op family, no torch) for AMD GPUs, on a machine with no GPU and no
# ROCm: Debian's clang-19 and lld-19 (installed with apt), and ROCm's HIP headers and device
# libraries from Debian 13's packages (libamdhip64-dev, rocm-device-libs-17), unpacked into a cache
# folder, not installed. Each object must hold a code object for its architecture with every
# kernel of the family in it. It proves HIP's compiler takes the kernels, not that they run.
#   tools/rocm_build_check.sh         (gfx1151 gfx942 gfx90a; MINAGI_ROCM_ARCHS="gfx1100" overrides)
# Cache: ${MINAGI_ROCM_CACHE:-~/.cache/minagi-rocm}. Where apt, root (or sudo) or the packages
# cannot be had it prints why it skipped and exits 0, so CI elsewhere does not fail; a compile
# error, or a kernel missing from an object, exits 1.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${MINAGI_ROCM_CACHE:-$HOME/.cache/minagi-rocm}
archs=${MINAGI_ROCM_ARCHS:-gfx1151 gfx942 gfx90a}
suite=trixie  # Debian 13: the first with device libraries for gfx1151
skip() { echo "rocm_build_check: SKIPPED: $*"; exit 0; }
as_root() {
  if [[ $(id -u) -eq 0 ]]; then "$@"
  elif command -v sudo > /dev/null && sudo -n true 2> /dev/null; then sudo "$@"
  else return 1
  fi
}

command -v apt-get > /dev/null || skip "no apt-get: it takes clang-19 and ROCm's headers from Debian's packages"
command -v dpkg > /dev/null || skip "no dpkg to unpack the ROCm packages with"

# 1. clang-19, lld-19 (the device link), clang-tools-19 (the offload bundler) and llvm-19 (objcopy,
# readelf for the checks), from the system's own apt sources.
tools=(clang++-19 ld.lld-19 llvm-objcopy-19 llvm-readelf-19 /usr/lib/llvm-19/bin/clang-offload-bundler)
have_tools() { for t in "${tools[@]}"; do command -v "$t" > /dev/null || return 1; done; }
if ! have_tools; then
  packages=(clang-19 lld-19 clang-tools-19 llvm-19)
  echo "rocm_build_check: installing ${packages[*]} with apt"
  as_root true || skip "${packages[*]} are not all installed and installing them needs root or sudo"
  install() { as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" > /dev/null; }
  if ! install; then
    as_root apt-get update -q > /dev/null || skip "apt-get update failed (no network?)"
    install || skip "apt-get could not install ${packages[*]} (not in this system's Debian or Ubuntu release?)"
  fi
fi
clang=clang++-19
bundler=/usr/lib/llvm-19/bin/clang-offload-bundler

# 2. The HIP headers and device libraries, downloaded with a private apt configuration that
# reads Debian 13's package list into the cache: the system's sources are not touched.
rocm=$cache/root
if [[ ! -f $cache/unpacked ]]; then
  echo "rocm_build_check: fetching libamdhip64-dev and rocm-device-libs-17 from Debian $suite into $cache"
  rm -rf "$cache" && mkdir -p "$cache/apt/lists/partial" "$cache/apt/archives/partial" "$cache/debs" "$rocm"
  echo "deb http://deb.debian.org/debian $suite main" > "$cache/apt/sources.list"
  opts=(-o "Dir::Etc::SourceList=$cache/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$cache/apt/lists" -o "Dir::Cache=$cache/apt" -o Debug::NoLocking=1
        -o APT::Sandbox::User=root -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null)
  apt-get "${opts[@]}" update -q > "$cache/apt/update.log" 2>&1 ||
    skip "reading Debian $suite's package list failed (no network?): $(tail -1 "$cache/apt/update.log")"
  (cd "$cache/debs" && apt-get "${opts[@]}" download libamdhip64-dev rocm-device-libs-17 > "$cache/apt/download.log" 2>&1) ||
    skip "downloading the ROCm packages failed: $(tail -1 "$cache/apt/download.log")"
  for deb in "$cache"/debs/*.deb; do dpkg -x "$deb" "$rocm"; done
  rm -rf "$cache/apt/lists" "$cache/apt/archives"
  (cd "$cache/debs" && ls *.deb) > "$cache/unpacked"
fi
bitcode=$(dirname "$(find "$rocm" -name "oclc_isa_version_1151.bc" | head -1)")
[[ -d $bitcode && -f $rocm/usr/include/hip/hip_runtime.h ]] || { echo "rocm_build_check: FAIL: $cache holds no HIP headers or device libraries; delete it and rerun"; exit 1; }
echo "rocm_build_check: $($clang --version | head -1); ROCm packages: $(tr '\n' ' ' < "$cache/unpacked")"

# 3. Every family for every architecture; each object's code object must list the family's kernels.
declare -A expect=([routing]=8 [grouping]=5 [gather]=12 [grouped_gemm]=13 [activation]=12)  # kernels x dtypes
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for arch in $archs; do
  start=$(date +%s%N)
  for src in "$root"/tools/rocm_check/*.cpp; do
    family=$(basename "$src" .cpp)
    obj=$work/$family-$arch.o
    if ! $clang -x hip --offload-arch="$arch" --rocm-path="$rocm/usr" --rocm-device-lib-path="$bitcode" \
        -std=c++17 -O2 -Wall -Wextra -Werror -c "$src" -o "$obj" 2> "$work/err"; then
      echo "rocm_build_check: FAIL: $family for $arch:"; head -40 "$work/err"; status=1; continue
    fi
    llvm-objcopy-19 --dump-section .hip_fatbin="$work/fatbin" "$obj"
    "$bundler" --unbundle --type=o --input="$work/fatbin" --targets="hipv4-amdgcn-amd-amdhsa--$arch" \
      --output="$work/co" 2> "$work/err" || { echo "rocm_build_check: FAIL: no $arch code object in $family"; status=1; continue; }
    kernels=$(llvm-readelf-19 --notes "$work/co" | grep -c "\.name: .*_kernel" || true)
    if [[ $kernels -ne ${expect[$family]:-0} ]]; then
      echo "rocm_build_check: FAIL: $family for $arch holds $kernels kernels, expected ${expect[$family]:-?}"; status=1
    fi
  done
  ms=$((($(date +%s%N) - start) / 1000000))
  printf "rocm_build_check: %-8s %s families in %d.%01d s\n" "$arch" "${#expect[@]}" $((ms / 1000)) $((ms % 1000 / 100))
done
[[ $status -eq 0 ]] && echo "rocm_build_check: OK: every kernel header compiled for $archs"
exit $status
