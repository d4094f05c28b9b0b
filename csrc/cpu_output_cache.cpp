// Freed large outputs of the CPU kernels, kept for the next call that needs the same size.
// glibc returns every freed block above its mmap threshold (at most 32 MiB) to the OS, so
// without a cache each step over 1e7 weights maps its mask, statistics and gradient anew,
// and the kernel zeroes every fresh page on first touch (on a 2-core VM the 2:4 step
// reached 0.32 of copy bandwidth so, 0.35-0.51 with the cache: docs/benchmarks.md).
// CUDA's caching allocator does the same for GPU memory. A block returns to the cache
// only when its last tensor is freed, so no live tensor's memory is ever handed out again.
#include "cpu_output_cache.h"

#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "cpu_outputs.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dtp {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;

// One block of the cache: its memory, rounded size, whether it was advised for huge
// pages (a block is reused only under the advice setting it was made with) and when it
// was last freed (the oldest go first when the cache is full).
struct Block {
  void* data;
  size_t bytes;
  bool huge;
  uint64_t freed_at;
};

class OutputCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const bool huge = huge_page_outputs.load(std::memory_order_relaxed);
    const size_t bytes = (std::max<size_t>(n, 1) + kHugePage - 1) / kHugePage * kHugePage;
    Block* block = take(bytes, huge);
    if (block == nullptr) block = fresh(bytes, huge);
    return {block->data, block, &OutputCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t set_limit(int64_t bytes) {
    int64_t previous;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      previous = static_cast<int64_t>(limit_);
      limit_ = static_cast<size_t>(bytes);
    }
    drop_above(static_cast<size_t>(bytes));
    return previous;
  }

  std::tuple<int64_t, int64_t, int64_t> info() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(cached_), static_cast<int64_t>(free_.size()),
            static_cast<int64_t>(limit_)};
  }

  static OutputCache& get() {
    // Never destroyed: tensors freed during interpreter shutdown still call release().
    static OutputCache* cache = new OutputCache();
    return *cache;
  }

 private:
  Block* take(size_t bytes, bool huge) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = free_.find({bytes, huge});
    if (it == free_.end()) return nullptr;
    Block* block = it->second;
    free_.erase(it);
    cached_ -= bytes;
    return block;
  }

  // Takes cached blocks out, the longest freed first, until at most `keep` bytes are
  // cached; the caller frees them outside the lock. A linear scan: the cache holds the
  // outputs of a step or two, tens of blocks.
  std::vector<Block*> evict_locked(size_t keep) {
    std::vector<Block*> evicted;
    while (cached_ > keep && !free_.empty()) {
      auto oldest = free_.begin();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second->freed_at < oldest->second->freed_at) oldest = it;
      }
      cached_ -= oldest->second->bytes;
      evicted.push_back(oldest->second);
      free_.erase(oldest);
    }
    return evicted;
  }

  void drop_above(size_t keep) {
    std::vector<Block*> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      evicted = evict_locked(keep);
    }
    for (Block* block : evicted) destroy(block);
  }

  Block* fresh(size_t bytes, bool huge) {
    void* data = std::aligned_alloc(kHugePage, bytes);
    if (data == nullptr) {  // the blocks held for reuse may be what is missing
      drop_above(0);
      data = std::aligned_alloc(kHugePage, bytes);
      TORCH_CHECK(data != nullptr, "dtp: out of CPU memory allocating ", bytes, " bytes");
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge) madvise(data, bytes, MADV_HUGEPAGE);
#endif
    return new Block{data, bytes, huge, 0};
  }

  static void destroy(Block* block) {
    std::free(block->data);
    delete block;
  }

  // The deleter of every tensor the cache made: the block is kept (older blocks making
  // room for it) unless it alone exceeds the limit.
  static void release(void* ctx) {
    Block* block = static_cast<Block*>(ctx);
    OutputCache& cache = get();
    std::vector<Block*> evicted;
    {
      std::lock_guard<std::mutex> lock(cache.mutex_);
      if (block->bytes <= cache.limit_) {
        block->freed_at = ++cache.clock_;
        cache.free_.insert({{block->bytes, block->huge}, block});
        cache.cached_ += block->bytes;
        evicted = cache.evict_locked(cache.limit_);
        block = nullptr;
      }
    }
    for (Block* old : evicted) destroy(old);
    if (block != nullptr) destroy(block);
  }

  std::mutex mutex_;
  std::multimap<std::pair<size_t, bool>, Block*> free_;  // (bytes, huge) -> block
  size_t cached_ = 0;
  size_t limit_ = kDefaultOutputCacheLimit;
  uint64_t clock_ = 0;
};

}  // namespace

at::Tensor cached_empty(at::IntArrayRef size, const at::TensorOptions& options,
                        std::optional<c10::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, &OutputCache::get(),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), memory_format);
}

int64_t set_output_cache_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "set_cpu_output_cache: limit_bytes must be >= 0, got ", bytes);
  return OutputCache::get().set_limit(bytes);
}

std::tuple<int64_t, int64_t, int64_t> output_cache_info() { return OutputCache::get().info(); }

}  // namespace dtp
