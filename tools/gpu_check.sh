#!/usr/bin/env bash
# The GPU checks of the dispatch ops as one prepared run, for a machine with a CUDA or ROCm GPU
# and a GPU build of torch (the device machine's python3, or your own): build the extension with
# its GPU kernels, the sync-free test (expert_mlp and tiny transformers models under CUDA's sync
# debug mode "error"), the GPU cases of the tests, the dispatch benchmark on the GPU (bfloat16,
# with torch._grouped_mm's row beside minagi's), the reserved-memory test and a short soak. Writes logs and the benchmark's JSON under ${OUT:-gpu-check}.
#   bash tools/gpu_check.sh            (MINAGI_ARCHS=9.0 for an H100/H200, gfx1151 for Strix Halo)
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$SECONDS
# The system's compiler where there is one: an extension built by another g++ (a device image's
# CXX=/opt/gcc/bin/g++) carried its own libstdc++ stream code, and every error the extension
# raised (TORCH_CHECK's message) crashed the process instead.
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
echo "== build (MINAGI_ARCHS=${MINAGI_ARCHS:-torch default}, CXX=${CXX:-default})"
MINAGI_REQUIRE_EXT=1 "$py" setup.py build_ext --inplace > "$out/build.log" 2>&1 || {
  tail -40 "$out/build.log"; echo "gpu_check: build FAILED after $((SECONDS-start)) s"; exit 1; }
echo "built in $((SECONDS-start)) s"
"$py" -m minagi doctor 2>&1 | tee "$out/doctor.txt"
echo "== sync-free: expert_mlp and tiny transformers models, forward and backward, sync debug mode 'error'"
MINAGI_REQUIRE_EXT=1 timeout 600 "$py" -m pytest -q tests/test_gpu.py -p no:cacheprovider \
  -k "never_synchronise or deterministic" 2>&1 | tee "$out/sync_free.log" | tail -15
echo "== GPU tests"
MINAGI_REQUIRE_EXT=1 timeout 900 "$py" -m pytest -q -x -k "cuda or test_gpu" tests -p no:cacheprovider \
  2>&1 | tee "$out/tests.log" | tail -25
echo "== dispatch benchmark (GPU, bfloat16; the grouped_mm row is torch._grouped_mm's)"
timeout 600 "$py" -m minagi.bench dispatch --device cuda --reps 10 --json "$out/bench_dispatch.json" \
  2>&1 | tee "$out/bench_dispatch.txt"
echo "== writing on the GPU (the decode kernel: top_k experts' weights read in place)"
"$py" train.py --profile strix-large --steps 1 --set train.batch=1 --set data.context=64 --set train.device=cuda \
  --quiet --out "$out/large" > "$out/large.txt" 2>&1 && \
  timeout 300 "$py" -m minagi.bench write "$out/large" --device cuda 2>&1 | tee "$out/bench_write.txt"
echo "== soak (GPU, 2 minutes of the default profile: reserved memory and throughput over time)"
timeout 300 "$py" -m minagi.bench soak --device cuda --minutes 2 --every 10 --out "$out/soak" \
  2>&1 | tee "$out/soak.txt" | tail -3
echo "gpu_check: done in $((SECONDS-start)) s"
