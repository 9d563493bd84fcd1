// A cache of large CPU blocks, installed as torch's CPU allocator on request (MINAGI_ALLOCATOR=keep,
// minagi.allocator.keep_freed_memory()). A training step makes the same large tensors every step
// (activations, weight gradients); glibc maps each one over 32 MiB afresh and unmaps it when freed,
// and the kernel then zeroes and faults it in page by page: a fifth of a MoE block's forward+backward
// on this project's CPU. Telling glibc to keep freed memory (mallopt) does not help: the small
// allocations made between two steps are carved out of the freed block, the next large one no
// longer fits, and the heap grows by a block every step. Here a block of 1 MiB or more is its own
// mapping, rounded up to whole 2 MiB pages and advised onto huge pages, and when freed it waits,
// still faulted in, for the next request of its size (up to 25% larger), within a cap on idle
// bytes. Smaller requests go to the allocator this one replaced. Huge pages for the 1-4 MiB
// blocks too: without them transformers' grouped_mm, which makes many such tensors a step, runs
// a training step visibly slower (docs/log/2026-12-05-keeping-freed-memory.md); the price is up
// to 2x the memory of a tensor just over 1 MiB.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#ifndef _WIN32
#include <pthread.h>
#include <sys/mman.h>
#endif

namespace minagi {
#ifndef _WIN32
namespace {

constexpr size_t kHuge = size_t{2} << 20;      // one huge page: the blocks' grain
constexpr size_t kMinBytes = size_t{1} << 20;  // below: glibc's heap serves these well

class BlockCache final : public c10::Allocator {
 public:
  explicit BlockCache(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes) return base_->allocate(n);
    const size_t size = (n + kHuge - 1) / kHuge * kHuge;
    void* p = take(size);
    if (p == nullptr) p = map(size);
    if (p == nullptr) return base_->allocate(n);  // out of address space: the base says so its way
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter() ? &release : nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Sets the cap on idle bytes (unmapping idle blocks past it); returns {idle bytes, blocks
  // reused, blocks mapped}.
  std::vector<int64_t> configure(int64_t max_idle) {
    if (max_idle >= 0) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        cap_ = static_cast<size_t>(max_idle);
      }
      trim(static_cast<size_t>(max_idle));
    }
    std::lock_guard<std::mutex> lock(mu_);
    return {static_cast<int64_t>(idle_bytes_), reused_, mapped_};
  }

  // fork() while another thread holds the lock would leave the child's copy locked forever.
  void lock_for_fork() { mu_.lock(); }
  void unlock_after_fork() { mu_.unlock(); }

 private:
  static void release(void* p);

  // Unmaps idle blocks, the largest first, until at most `target` idle bytes are left (the cap
  // stays as it is). The unmapping happens outside the lock.
  void trim(size_t target) {
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (idle_bytes_ > target) {
        auto it = std::prev(idle_.end());
        drop.emplace_back(it->second, it->first);
        idle_bytes_ -= it->first;
        sizes_.erase(it->second);
        idle_.erase(it);
      }
    }
    for (const auto& [p, size] : drop) munmap(p, size);
  }

  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.lower_bound(size);
    if (it == idle_.end() || it->first > size + size / 4) return nullptr;
    void* p = it->second;
    idle_bytes_ -= it->first;
    idle_.erase(it);
    ++reused_;
    return p;
  }

  void* map(size_t size) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      trim(0);  // hand the idle blocks back and try once more
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return nullptr;
    }
#ifdef MADV_HUGEPAGE
    madvise(p, size, MADV_HUGEPAGE);
#endif
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[p] = size;
    ++mapped_;
    return p;
  }

  // A block of ours goes back to the idle set (or is unmapped past the cap); a pointer that is not
  // ours came from the base allocator through raw_allocate.
  bool give_back(void* p) {
    size_t unmap = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sizes_.find(p);
      if (it == sizes_.end()) return false;
      const size_t size = it->second;
      if (idle_bytes_ + size <= cap_) {
        idle_.emplace(size, p);
        idle_bytes_ += size;
      } else {
        sizes_.erase(it);
        unmap = size;
      }
    }
    if (unmap) munmap(p, unmap);
    return true;
  }

  c10::Allocator* base_;
  std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;  // every block of ours, idle or live
  std::multimap<size_t, void*> idle_;        // size -> block
  size_t idle_bytes_ = 0, cap_ = 0;
  int64_t reused_ = 0, mapped_ = 0;
};

// Made once, never destroyed (blocks may be freed at exit); set before the cache is installed, so
// a block freed on another thread right after installation finds it.
std::atomic<BlockCache*> g_cache{nullptr};

void BlockCache::release(void* p) {
  BlockCache* cache = g_cache.load();
  if (p == nullptr || cache->give_back(p)) return;
  c10::DeleterFnPtr base = cache->base_->raw_deleter();
  if (base == nullptr) {  // a deleter cannot throw: raw_deleter() is null in this case, so unreachable
    std::fputs("minagi block cache: asked to free a pointer it did not make\n", stderr);
    std::abort();
  }
  base(p);
}

std::mutex g_install;

void before_fork() { g_cache.load()->lock_for_fork(); }
void after_fork() { g_cache.load()->unlock_after_fork(); }

}  // namespace
#endif

// The op behind minagi.allocator.keep_freed_memory(): max_idle_bytes >= 0 installs the cache as
// torch's CPU allocator (once) and sets its cap on idle bytes (0: keep nothing, hand the idle
// blocks back); -1 only reports. Returns {installed (0/1), idle bytes, blocks reused, blocks mapped}.
std::vector<int64_t> cpu_block_cache(int64_t max_idle_bytes) {
#ifdef _WIN32
  return {0, 0, 0, 0};  // no mmap: the allocator stays as it is
#else
  std::lock_guard<std::mutex> lock(g_install);
  if (g_cache.load() == nullptr && max_idle_bytes > 0) {  // a cap of 0 installs nothing
    auto* cache = new BlockCache(c10::GetCPUAllocator());
    g_cache.store(cache);
    c10::SetCPUAllocator(cache, /*priority=*/1);
    if (c10::GetCPUAllocator() != cache) {  // another allocator of higher priority stays; nothing changed
      g_cache.store(nullptr);
      delete cache;
      TORCH_CHECK(false, "minagi block cache: torch keeps another CPU allocator of higher priority");
    }
    pthread_atfork(&before_fork, &after_fork, &after_fork);
  }
  BlockCache* cache = g_cache.load();
  if (cache == nullptr) return {0, 0, 0, 0};
  auto stats = cache->configure(max_idle_bytes);
  stats.insert(stats.begin(), 1);
  return stats;
#endif
}

}  // namespace minagi
