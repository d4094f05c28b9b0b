// Large outputs of the CPU kernels: blocks of memory kept for reuse after their tensors
// are freed (cpu_output_cache.cpp), so a step does not map and zero fresh pages for them
// every call, and new blocks backed by transparent huge pages where Linux offers them
// (madvise(MADV_HUGEPAGE) before the first write: 512 times fewer faults, as torch asks
// for all its allocations under THP_MEM_ALLOC_ENABLE=1).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "cpu_output_cache.h"
#include "lent_state_outputs.h"

namespace dtp {

// On by default; dtp_kernels.set_cpu_huge_pages(False) turns the advice off for new
// blocks (a system whose THP compaction stalls, or a benchmark of both).
inline std::atomic<bool> huge_page_outputs{true};

// Outputs of at least this many bytes come from the cache; smaller ones from at::empty
// (glibc reuses freed memory below its mmap threshold by itself).
constexpr int64_t kCachedOutputBytes = int64_t(4) << 20;

// at::empty of a contiguous kernel output.
inline at::Tensor empty_output(at::IntArrayRef size, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (const int64_t n : size) numel *= n;
  if (numel * static_cast<int64_t>(options.dtype().itemsize()) < kCachedOutputBytes) {
    return at::empty(size, options);
  }
  return cached_empty(size, options);
}

// at::empty_like(t) of a kernel output, in t's (contiguous or channels-last) layout.
inline at::Tensor empty_output_like(const at::Tensor& t) {
  const auto format = t.suggest_memory_format();
  if (t.nbytes() < static_cast<size_t>(kCachedOutputBytes) || !t.is_contiguous(format)) {
    return at::empty_like(t);
  }
  return cached_empty(t.sizes(), t.options(), format);
}

// The next state's outputs of a CPU kernel: TransportState's pending buffers when the
// eager step entry lent them (lent_state_outputs.h), else fresh ones.
inline StateOutputs take_state_outputs(const at::Tensor& scores, const at::Tensor& log_odds,
                                       const at::Tensor& shift) {
  if (auto lent = take_lent_state_outputs(scores, log_odds, shift)) return *std::move(lent);
  return {empty_output({log_odds.numel()}, log_odds.options()), at::empty_like(shift),
          at::empty({shift.numel()}, shift.options().dtype(at::kBool))};
}

}  // namespace dtp
