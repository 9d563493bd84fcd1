// A CPU emulator of the CUDA thread model, enough to run minagi's kernels (csrc/cuda/*_kernels.cuh)
// on a machine without a GPU, C++20 standard library only. Every thread of a block is a
// std::thread, so the block's threads really interleave and ThreadSanitizer sees their races; a
// header-only HIP-on-CPU library that runs a block's threads one after another hides them.
//   - gridDim / blockDim / blockIdx / threadIdx are thread_local;
//   - __syncthreads is a std::barrier per block; a thread that returns from the kernel drops out
//     of it, as an exited GPU thread does;
//   - shared memory (dynamic, and MINAGI_SHARED_ARRAY's static arrays) is per block, filled with
//     0xFF bytes before each block so that a read of an element nobody wrote shows (NaN, -1);
//   - atomicAdd goes through std::atomic_ref;
//   - launch(kernel, grid, block, dynamic_smem_bytes, args...) runs a kernel: `resident` blocks
//     at a time (two by default, so races between blocks show too), each block's threads taking
//     the next block when it is done.
// Launches fail as the GPU's would: more than 1,024 threads per block, a grid past CUDA's limits,
// more than 48 KiB of shared memory. A failed CUDA_KERNEL_ASSERT aborts, naming the condition.
#pragma once

#ifndef MINAGI_EMULATOR
#define MINAGI_EMULATOR 1
#endif

#include <math.h>  // exp(float) etc. in the global namespace, as CUDA's device overloads are

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{};
inline thread_local dim3 gridDim{};

namespace minagi {
namespace emu {

constexpr size_t kSharedBytes = 48 * 1024;  // per block, without the opt-in to more
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxGridYZ = 65535;
constexpr unsigned char kPoison = 0xFF;

[[noreturn]] inline void kernel_assert_failed(const char* cond, const char* file, int line) {
  std::fprintf(stderr, "%s:%d: CUDA_KERNEL_ASSERT failed in block (%u, %u), thread %u: %s\n", file, line,
               blockIdx.x, blockIdx.y, threadIdx.x, cond);
  std::abort();
}

// One resident block: its __syncthreads barrier and its shared memory.
struct Block {
  std::optional<std::barrier<>> sync;
  std::vector<std::max_align_t> dynamic, statics;
  size_t dynamic_bytes = 0;
};

inline thread_local Block* tl_block = nullptr;
inline thread_local size_t tl_static_used = 0;

inline void* dynamic_shared() { return tl_block->dynamic.data(); }

// The i-th MINAGI_SHARED_ARRAY a thread meets in a block: every thread of the block declares the
// same arrays in the same order, so each thread's own cursor gives all of them the same address.
template <typename T>
T* static_shared(size_t count) {
  const size_t align = alignof(T), offset = (tl_static_used + align - 1) / align * align;
  const size_t end = offset + count * sizeof(T);
  if (end + tl_block->dynamic_bytes > kSharedBytes) {
    std::fprintf(stderr, "emulator: %zu bytes of static and %zu of dynamic shared memory exceed %zu\n", end,
                 tl_block->dynamic_bytes, kSharedBytes);
    std::abort();
  }
  tl_static_used = end;
  return reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(tl_block->statics.data()) + offset);
}

inline int& resident_blocks() {
  static int n = 2;
  return n;
}

inline uint3 unflatten(uint64_t i, dim3 shape) {
  return {static_cast<unsigned>(i % shape.x), static_cast<unsigned>(i / shape.x % shape.y),
          static_cast<unsigned>(i / (uint64_t{shape.x} * shape.y))};
}

inline void check_launch(dim3 grid, dim3 block, size_t dynamic_bytes) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64)
    throw std::invalid_argument("emulator: invalid block of " + std::to_string(threads) + " threads");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > kMaxGridYZ || grid.z > kMaxGridYZ)
    throw std::invalid_argument("emulator: invalid grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) +
                                ", " + std::to_string(grid.z) + ")");
  if (dynamic_bytes > kSharedBytes)
    throw std::invalid_argument("emulator: " + std::to_string(dynamic_bytes) + " bytes of dynamic shared memory");
}

// kernel<<<grid, block, dynamic_bytes>>>(args...), returning when every block has run.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_bytes, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "emulator launch: wrong number of kernel arguments");
  check_launch(grid, block, dynamic_bytes);
  const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  const unsigned T = block.x * block.y * block.z;
  const uint64_t n_blocks = uint64_t{grid.x} * grid.y * grid.z;
  const unsigned R = static_cast<unsigned>(std::min<uint64_t>(std::max(resident_blocks(), 1), n_blocks));
  std::vector<Block> blocks(R);
  std::vector<std::optional<std::barrier<>>> turn(R);  // the block's threads between two blocks
  for (unsigned g = 0; g < R; ++g) {
    blocks[g].dynamic.resize((dynamic_bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t) + 1);
    blocks[g].statics.resize(kSharedBytes / sizeof(std::max_align_t));
    blocks[g].dynamic_bytes = dynamic_bytes;
    turn[g].emplace(T);
  }
  auto worker = [&](unsigned g, unsigned t) {
    Block& b = blocks[g];
    gridDim = grid;
    blockDim = block;
    threadIdx = unflatten(t, block);
    for (uint64_t id = g; id < n_blocks; id += R) {
      if (t == 0) {
        b.sync.emplace(T);
        std::memset(b.dynamic.data(), kPoison, b.dynamic.size() * sizeof(std::max_align_t));
        std::memset(b.statics.data(), kPoison, b.statics.size() * sizeof(std::max_align_t));
      }
      turn[g]->arrive_and_wait();
      tl_block = &b;
      tl_static_used = 0;
      blockIdx = unflatten(id, grid);
      std::apply(kernel, params);
      b.sync->arrive_and_drop();
      turn[g]->arrive_and_wait();  // every thread is out of this block before the next one starts
    }
    tl_block = nullptr;
  };
  std::vector<std::thread> threads;
  threads.reserve(uint64_t{R} * T);
  for (unsigned g = 0; g < R; ++g)
    for (unsigned t = 0; t < T; ++t) threads.emplace_back(worker, g, t);
  for (std::thread& th : threads) th.join();
}

}  // namespace emu
}  // namespace minagi

inline void __syncthreads() { ::minagi::emu::tl_block->sync->arrive_and_wait(); }

// CUDA's atomicAdd overloads (int, unsigned long long, ...): the pointer picks the type and the
// value converts to it, as there.
template <typename T>
inline T atomicAdd(T* address, std::type_identity_t<T> value) {
  return std::atomic_ref<T>(*address).fetch_add(value, std::memory_order_relaxed);
}

#define CUDA_KERNEL_ASSERT(cond) \
  ((cond) ? static_cast<void>(0) : ::minagi::emu::kernel_assert_failed(#cond, __FILE__, __LINE__))
