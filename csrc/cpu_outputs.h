// Large outputs of the CPU kernels, backed by transparent huge pages where Linux offers
// them. A fresh allocation of tens of MB is mapped page by page as the kernel first writes
// it; with 4 KiB pages those faults cost as much as the kernel's own work (a mask step
// over 1e7 weights: half its time). madvise(MADV_HUGEPAGE) before the first write asks
// for 2 MiB pages instead, as torch does for all its allocations under
// THP_MEM_ALLOC_ENABLE=1.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dtp {

// On by default; dtp_kernels.set_cpu_huge_pages(False) turns the advice off (a system
// whose THP compaction stalls, or a benchmark of both).
inline std::atomic<bool> huge_page_outputs{true};

// Advises the 2 MiB-aligned part of a fresh CPU tensor of at least 4 MiB for huge pages
// and returns it. A hint: without THP, or where madvise fails, the pages are the usual
// ones. Call it before anything writes the tensor.
inline at::Tensor huge_page_hint(at::Tensor t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
  const uintptr_t bytes = t.nbytes();
  if (t.device().is_cpu() && bytes >= 2 * kHugePage &&
      huge_page_outputs.load(std::memory_order_relaxed)) {
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + bytes) & ~(kHugePage - 1);
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return t;
}

// at::empty of a kernel output, advised for huge pages.
inline at::Tensor empty_output(at::IntArrayRef size, const at::TensorOptions& options) {
  return huge_page_hint(at::empty(size, options));
}

}  // namespace dtp
