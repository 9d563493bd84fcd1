// Runs minagi's GPU kernels (csrc/cuda/*_kernels.cuh) under the CPU emulator (csrc/emu/), case by
// case, for tests/test_gpu_emulated.py, which writes the cases and checks the outputs against the
// CPU kernels. Each case is a folder: case.txt ("key value" lines: kernel, dtype, sizes), its
// inputs as raw little-endian arrays (NAME.bin), and this program writes its outputs (got_NAME.bin).
// Each run_* below does what its torch launcher in csrc/cuda/*.cu does, with the same launch
// geometry (csrc/cuda/launch_geometry.h); outputs the launcher takes from at::empty start as
// 0xFF bytes, so an element no thread writes shows.
//   run_kernels [--resident-blocks R] CASE_DIR...
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../csrc/emu/emulator.h"
#include "../../csrc/cuda/activation_kernels.cuh"
#include "../../csrc/cuda/gather_kernels.cuh"
#include "../../csrc/cuda/grouped_gemm_kernels.cuh"
#include "../../csrc/cuda/grouping_kernels.cuh"
#include "../../csrc/cuda/launch_geometry.h"
#include "../../csrc/cuda/routing_kernels.cuh"

namespace {

namespace fs = std::filesystem;
using namespace minagi::gpu;
using minagi::emu::launch;

class Case {
 public:
  explicit Case(fs::path dir) : dir_(std::move(dir)) {
    std::ifstream in(dir_ / "case.txt");
    if (!in) throw std::runtime_error("no case.txt in " + dir_.string());
    std::string key, value;
    while (in >> key >> value) kv_[key] = value;
  }
  const std::string& str(const std::string& key) const {
    const auto it = kv_.find(key);
    if (it == kv_.end()) throw std::runtime_error(dir_.string() + ": case.txt has no " + key);
    return it->second;
  }
  int64_t num(const std::string& key) const { return std::stoll(str(key)); }
  int64_t num(const std::string& key, int64_t fallback) const { return kv_.count(key) ? num(key) : fallback; }

  template <typename T>
  std::vector<T> read(const std::string& name, int64_t count) const {
    const fs::path p = dir_ / (name + ".bin");
    const auto bytes = fs::file_size(p);
    if (bytes != static_cast<uintmax_t>(count) * sizeof(T))
      throw std::runtime_error(p.string() + ": " + std::to_string(bytes) + " bytes, expected " +
                               std::to_string(count) + " x " + std::to_string(sizeof(T)));
    std::vector<T> v(count);
    std::ifstream in(p, std::ios::binary);
    in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(bytes));
    return v;
  }
  template <typename T>
  void write(const std::string& name, const std::vector<T>& v) const {
    std::ofstream out(dir_ / ("got_" + name + ".bin"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  }

 private:
  fs::path dir_;
  std::map<std::string, std::string> kv_;
};

// An at::empty output: every byte 0xFF until a kernel writes it.
template <typename T>
std::vector<T> empty(int64_t n) {
  std::vector<T> v(n);
  std::memset(v.data(), minagi::emu::kPoison, n * sizeof(T));
  return v;
}

// The grid cap of the launchers' grid-stride kernels; a case may lower it to send small inputs
// through the loops.
int64_t max_blocks(const Case& c) { return c.num("max_blocks", kMaxBlocks); }

template <typename scalar_t>
void run_routing(const Case& c) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t N = c.num("N"), S = c.num("S"), k = c.num("k");
  const auto logits = c.read<scalar_t>("logits", N * S);
  auto idx = empty<int64_t>(N * k);
  auto gates = empty<scalar_t>(N * k);
  std::vector<int64_t> load(S, 0);
  if (N > 0) {
    const int threads = pow2_threads(S, kMinThreads, 256);
    launch(routing_kernel<scalar_t>, dim3(blocks_for(N, 1, max_blocks(c))), dim3(threads),
           routing_smem_bytes<acc_t>(S, threads, k), logits.data(), N, static_cast<int>(S), static_cast<int>(k),
           idx.data(), gates.data(), reinterpret_cast<unsigned long long*>(load.data()));
  }
  c.write("slot_idx", idx);
  c.write("gates", gates);
  c.write("load", load);
}

template <typename scalar_t>
void run_routing_backward(const Case& c) {
  const int64_t N = c.num("N"), S = c.num("S"), k = c.num("k");
  const auto grad = c.read<scalar_t>("grad_gates", N * k), gates = c.read<scalar_t>("gates", N * k);
  const auto idx = c.read<int64_t>("slot_idx", N * k);
  std::vector<scalar_t> out(N * S, scalar_t(0));
  if (N > 0) {
    launch(routing_backward_kernel<scalar_t>, dim3(blocks_for(N, kThreads, max_blocks(c))), dim3(kThreads), 0,
           grad.data(), gates.data(), idx.data(), N, static_cast<int>(k), S, out.data());
  }
  c.write("out", out);
}

// group_plan_cuda's four launches and its one host read of the plan's sizes.
void run_group_plan(const Case& c) {
  const int64_t N = c.num("N"), k = c.num("k"), R = N * k, capacity = c.num("capacity");
  const int S = static_cast<int>(c.num("S"));
  const bool bucketed = c.num("bucketed") != 0, skip_invalid = c.num("skip_invalid", 0) != 0;
  const auto idx = c.read<int64_t>("slot_idx", R);
  const int64_t n_chunks = (R + kChunk - 1) / kChunk;
  auto chunk_count = empty<int>(std::max<int64_t>(1, S * n_chunks));
  std::vector<int64_t> total(S, 0);
  if (R > 0 && !skip_invalid) {
    launch(slot_range_kernel, dim3(blocks_for(R, kThreads, max_blocks(c))), dim3(kThreads), 0, idx.data(), R, S);
  }
  if (R > 0) {
    launch(chunk_hist_kernel, dim3(n_chunks), dim3(kChunk), S * sizeof(int), idx.data(), R, S, n_chunks,
           chunk_count.data());
    launch(slot_scan_kernel, dim3((S + 127) / 128), dim3(128), 0, chunk_count.data(), S, n_chunks, total.data());
  }
  auto load = empty<int64_t>(S), order = empty<int64_t>(S), start = empty<int64_t>(S), meta = empty<int64_t>(2 + S);
  launch(plan_kernel, dim3(1), dim3(pow2_threads(S, kMinThreads, 1024)), 2 * S * sizeof(int64_t), total.data(), S,
         capacity, bucketed, load.data(), order.data(), start.data(), meta.data());
  const int64_t A = meta[0], E = meta[1];
  if (A < 0 || A > S || E < 0) throw std::runtime_error("plan_kernel wrote A=" + std::to_string(A) + ", E=" +
                                                        std::to_string(E));
  std::vector<int64_t> row_pair(bucketed ? E : R, -1);  // an exact plan: a row per pair (grouping.cu)
  auto dest = empty<int64_t>(R);
  if (R > 0) {
    launch(fill_kernel, dim3(n_chunks), dim3(kChunk), 0, idx.data(), R, S, n_chunks, chunk_count.data(), load.data(),
           start.data(), dest.data(), row_pair.data());
  }
  c.write("load", load);
  c.write("slot_order", std::vector<int64_t>(order.begin(), order.begin() + A));
  c.write("slot_rows", std::vector<int64_t>(meta.begin() + 2, meta.begin() + 2 + A));
  c.write("row_pair", row_pair);
  c.write("dest", dest);
}

template <typename scalar_t>
void run_gather(const Case& c) {
  const int64_t N = c.num("N"), D = c.num("D"), k = c.num("k"), E = c.num("E");
  const auto x = c.read<scalar_t>("x", N * D);
  const auto row_pair = c.read<int64_t>("row_pair", E);
  const bool has_gates = c.num("gates") != 0;
  const auto gates = has_gates ? c.read<scalar_t>("gates", N * k) : std::vector<scalar_t>();
  auto out = empty<scalar_t>(E * D);
  if (E * D > 0) {
    launch(gather_kernel<scalar_t>, dim3(blocks_for(E * D, kThreads, max_blocks(c))), dim3(kThreads), 0, x.data(),
           row_pair.data(), has_gates ? gates.data() : nullptr, E, D, k, N * k, out.data());
  }
  c.write("out", out);
}

template <typename scalar_t>
void run_scatter(const Case& c) {
  const int64_t N = c.num("N"), D = c.num("D"), k = c.num("k"), E = c.num("E");
  const auto rows = c.read<scalar_t>("rows", E * D);
  const auto dest = c.read<int64_t>("dest", N * k);
  const bool has_gates = c.num("gates") != 0;
  const auto gates = has_gates ? c.read<scalar_t>("gates", N * k) : std::vector<scalar_t>();
  auto out = empty<scalar_t>(N * D);
  if (N * D > 0) {
    launch(scatter_kernel<scalar_t>, dim3(blocks_for(N * D, kThreads, max_blocks(c))), dim3(kThreads), 0,
           rows.data(), dest.data(), has_gates ? gates.data() : nullptr, N, D, k, E, out.data());
  }
  c.write("out", out);
}

template <typename scalar_t>
void run_gate_grad(const Case& c) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t N = c.num("N"), D = c.num("D"), k = c.num("k"), E = c.num("E");
  const auto a = c.read<scalar_t>("a", N * D), rows = c.read<scalar_t>("rows", E * D);
  const auto dest = c.read<int64_t>("dest", N * k);
  auto out = empty<scalar_t>(N * k);
  if (N * k > 0) {
    const int threads = pow2_threads(D, kMinThreads, 256);
    launch(gate_grad_kernel<scalar_t>, dim3(blocks_for(N * k, 1, max_blocks(c))), dim3(threads),
           threads * sizeof(acc_t), a.data(), rows.data(), dest.data(), N * k, D, k, E, out.data());
  }
  c.write("out", out);
}

// ranges.cuh: the listed slots' running row and tile counts (and int32 offsets), on the device.
struct Ranges {
  std::vector<int64_t> row_end, tile_end;
  std::vector<int> offs32;
};

Ranges run_offsets(const std::vector<int64_t>& rows, int64_t E) {
  const int64_t A = static_cast<int64_t>(rows.size());
  Ranges r{empty<int64_t>(A), empty<int64_t>(A), empty<int>(A)};
  if (A > 0) {
    launch(group_offsets_kernel<kOffsetThreads>, dim3(1), dim3(kOffsetThreads), 0, rows.data(), A, E,
           r.row_end.data(), r.tile_end.data(), r.offs32.data());
  }
  return r;
}

// torch._grouped_mm's part of the native path, on the host: listed position i's rows times b[i]
// (right where slot_ids[i] == i), the rows past the ranges left unwritten (poison).
template <typename scalar_t>
void host_identity_mm(const std::vector<scalar_t>& a, const std::vector<scalar_t>& b, int64_t s0, int64_t s1,
                      int64_t s2, const std::vector<int64_t>& row_end, int64_t K, int64_t M, std::vector<scalar_t>& out) {
  using acc_t = opmath_t<scalar_t>;
  for (size_t i = 0; i < row_end.size(); ++i) {
    for (int64_t r = i > 0 ? row_end[i - 1] : 0; r < row_end[i]; ++r) {
      for (int64_t m = 0; m < M; ++m) {
        acc_t acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += static_cast<acc_t>(a[r * K + k]) * static_cast<acc_t>(b[i * s0 + k * s1 + m * s2]);
        out[r * M + m] = static_cast<scalar_t>(acc);
      }
    }
  }
}

// grouped_gemm.cu's grouped_mm_cuda: the ranges, then (mode) the decode kernel ("small"), the
// tiled kernel ("tiled"), or torch._grouped_mm's identity part and the tiled kernel's fix-up of
// the slots whose id is not their position, with the tail ("native"). b is stored as `store`
// with the strides b_s0..2 (a transposed view reads the same bytes).
template <typename scalar_t>
void run_grouped_mm(const Case& c) {
  const int64_t A = c.num("A"), E = c.num("E"), K = c.num("K"), M = c.num("M"), S = c.num("S");
  const int64_t s0 = c.num("b_s0"), s1 = c.num("b_s1"), s2 = c.num("b_s2");
  const std::string& mode = c.str("mode");
  const auto a = c.read<scalar_t>("a", E * K), b = c.read<scalar_t>("b", S * K * M);
  const auto ids = c.read<int64_t>("slot_ids", A), rows = c.read<int64_t>("slot_rows", A);
  const Ranges r = run_offsets(rows, E);
  auto out = empty<scalar_t>(E * M);
  if (mode == "native") host_identity_mm(a, b, s0, s1, s2, r.row_end, K, M, out);
  if (E > 0 && M > 0 && mode == "small") {
    const dim3 grid(static_cast<unsigned>((M + kTileThreads - 1) / kTileThreads),
                    static_cast<unsigned>(std::clamp<int64_t>(A, 1, max_blocks(c))));
    launch(small_rows_kernel<scalar_t>, grid, dim3(kTileThreads), 0, a.data(), b.data(), s0, s1, s2, ids.data(),
           r.row_end.data(), A, E, K, M, S, out.data());
  } else if (E > 0 && M > 0) {
    const dim3 grid(static_cast<unsigned>((M + kTileN - 1) / kTileN),
                    static_cast<unsigned>(std::min<int64_t>(row_tile_bound(E, A), max_blocks(c))));
    launch(grouped_gemm_kernel<scalar_t>, grid, dim3(kTileThreads), 0, a.data(), b.data(), s0, s1, s2, ids.data(),
           r.row_end.data(), r.tile_end.data(), A, E, K, M, S, mode == "native", out.data());
  }
  c.write("out", out);
  c.write("row_end", r.row_end);
  c.write("offs32", r.offs32);
}

// grouped_mm_wgrad_cuda: zeros, then each listed slot's a^T @ grad over its rows.
template <typename scalar_t>
void run_wgrad(const Case& c) {
  const int64_t A = c.num("A"), E = c.num("E"), K = c.num("K"), M = c.num("M"), S = c.num("S");
  const auto a = c.read<scalar_t>("a", E * K), grad = c.read<scalar_t>("grad", E * M);
  const auto ids = c.read<int64_t>("slot_ids", A), rows = c.read<int64_t>("slot_rows", A);
  const Ranges r = run_offsets(rows, E);
  std::vector<scalar_t> out(S * K * M, scalar_t(0));
  if (A > 0 && K > 0 && M > 0) {
    const dim3 grid(static_cast<unsigned>((M + kTileN - 1) / kTileN), static_cast<unsigned>((K + kTileM - 1) / kTileM),
                    static_cast<unsigned>(std::min<int64_t>(A, max_blocks(c))));
    launch(wgrad_kernel<scalar_t>, grid, dim3(kTileThreads), 0, a.data(), grad.data(), ids.data(), r.row_end.data(),
           A, K, M, S, out.data());
  }
  c.write("out", out);
}

// activation.cu's grouped_mm_act epilogue (bias + activation over the GEMM's output, h in place)
// and expert_act_backward (the activation's backward, then the bias gradient per listed slot),
// each row's slot found from the ranges' ends.
template <typename scalar_t>
void run_activation(const Case& c) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t E = c.num("E"), M = c.num("M"), A = c.num("A"), S = c.num("S"), act = c.num("act");
  const int64_t W = act >= static_cast<int64_t>(minagi::Act::Swiglu) ? M / 2 : M;
  const acc_t alpha = static_cast<acc_t>(c.num("alpha_milli") / 1000.0), limit = static_cast<acc_t>(c.num("limit_milli") / 1000.0);
  auto h = c.read<scalar_t>("h", E * M);
  const auto bias = c.read<scalar_t>("bias", S * M), grad = c.read<scalar_t>("grad", E * W);
  const auto ids = c.read<int64_t>("slot_ids", A), rows = c.read<int64_t>("slot_rows", A);
  const Ranges r = run_offsets(rows, E);
  auto out = empty<scalar_t>(E * W), grad_h = empty<scalar_t>(E * M);
  std::vector<scalar_t> grad_bias(S * M, scalar_t(0));
  if (E * W > 0) {
    const dim3 grid(static_cast<unsigned>(blocks_for(E * W, kThreads, max_blocks(c))));
    launch(bias_act_kernel<scalar_t>, grid, dim3(kThreads), 0, h.data(), bias.data(), ids.data(), r.row_end.data(), A,
           out.data(), E, M, static_cast<int>(act), alpha, limit);
    launch(act_backward_kernel<scalar_t>, grid, dim3(kThreads), 0, grad.data(), h.data(), grad_h.data(), E, M,
           static_cast<int>(act), alpha, limit);
    if (A > 0) {
      const dim3 bgrid(static_cast<unsigned>((M + kThreads - 1) / kThreads),
                       static_cast<unsigned>(std::min<int64_t>(A, max_blocks(c))));
      launch(bias_grad_kernel<scalar_t>, bgrid, dim3(kThreads), 0, grad_h.data(), ids.data(), r.row_end.data(), A, M,
             S, grad_bias.data());
    }
  }
  c.write("h", h);
  c.write("out", out);
  c.write("grad_h", grad_h);
  c.write("grad_bias", grad_bias);
}

// Deliberate races, for the test that shows ThreadSanitizer sees the emulator's threads race:
// a read of shared memory another thread wrote with no __syncthreads between, and blocks that
// count into one global without an atomic.
__global__ void probe_missing_barrier(int* out) {
  int* s = dynamic_smem<int>();
  s[threadIdx.x] = static_cast<int>(threadIdx.x);
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

__global__ void probe_plain_global_count(unsigned long long* count) {
  if (threadIdx.x == 0) *count += 1;
}

void run_race_probe(const Case& c) {
  const unsigned blocks = 4, threads = 64;
  std::vector<int> out(blocks * threads);
  unsigned long long count = 0;
  if (c.str("probe") == "missing_barrier") {
    launch(probe_missing_barrier, dim3(blocks), dim3(threads), threads * sizeof(int), out.data());
  } else {
    launch(probe_plain_global_count, dim3(blocks), dim3(threads), 0, &count);
  }
}

template <typename scalar_t>
void run_floating(const Case& c, const std::string& kernel) {
  if (kernel == "routing") return run_routing<scalar_t>(c);
  if (kernel == "routing_backward") return run_routing_backward<scalar_t>(c);
  if (kernel == "gather") return run_gather<scalar_t>(c);
  if (kernel == "scatter") return run_scatter<scalar_t>(c);
  if (kernel == "gate_grad") return run_gate_grad<scalar_t>(c);
  if (kernel == "grouped_mm") return run_grouped_mm<scalar_t>(c);
  if (kernel == "wgrad") return run_wgrad<scalar_t>(c);
  if (kernel == "activation") return run_activation<scalar_t>(c);
  throw std::runtime_error("unknown kernel " + kernel);
}

void run_case(const Case& c) {
  const std::string& kernel = c.str("kernel");
  if (kernel == "group_plan") return run_group_plan(c);
  if (kernel == "race_probe") return run_race_probe(c);
  const std::string& dtype = c.str("dtype");
  if (dtype == "float32") return run_floating<float>(c, kernel);
  if (dtype == "float64") return run_floating<double>(c, kernel);
  if (dtype == "float16") return run_floating<Half>(c, kernel);
  if (dtype == "bfloat16") return run_floating<BFloat16>(c, kernel);
  throw std::runtime_error("unknown dtype " + dtype);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> dirs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--resident-blocks" && i + 1 < argc) {
      minagi::emu::resident_blocks() = std::stoi(argv[++i]);
    } else {
      dirs.push_back(arg);
    }
  }
  for (const std::string& d : dirs) {
    std::fprintf(stderr, "case %s\n", d.c_str());
    try {
      run_case(Case(d));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "case %s failed: %s\n", d.c_str(), e.what());
      return 1;
    }
  }
  return 0;
}
