// Large outputs of the CPU kernels, backed by transparent huge pages where Linux offers
// them. A fresh allocation of tens of MB is mapped page by page as the kernel first writes
// it, 512 times fewer faults with 2 MiB pages (what that saves varies with the machine:
// docs/benchmarks.md). madvise(MADV_HUGEPAGE) before the first write asks
// for 2 MiB pages, as torch does for all its allocations under THP_MEM_ALLOC_ENABLE=1.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>

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

// TransportState's pending buffers, lent by the eager step entry (transport_step.cpp) to
// the CPU kernel of dtp::transport_mask it calls, which writes the next log-odds, shift
// and non-finite flags straight into them: no allocation of a state-sized output (fresh
// pages) and no copy afterwards.
struct StateOutputs {
  at::Tensor log_odds, shift, nonfinite;
};

// The buffers lent to the next CPU kernel on this thread (null: none). The kernel takes
// them at most once (take_state_outputs), so an op nested inside cannot write them too.
inline thread_local const StateOutputs* lent_state_outputs = nullptr;

// Lends `outputs` for the scope of one op call.
class LendStateOutputs {
 public:
  explicit LendStateOutputs(const StateOutputs* outputs) : previous_(lent_state_outputs) {
    lent_state_outputs = outputs;
  }
  ~LendStateOutputs() { lent_state_outputs = previous_; }
  LendStateOutputs(const LendStateOutputs&) = delete;
  LendStateOutputs& operator=(const LendStateOutputs&) = delete;

 private:
  const StateOutputs* previous_;
};

// The lent buffers when they fit the kernel's outputs exactly (contiguous CPU tensors
// of the state's dtype and sizes, none aliasing an input), else fresh outputs.
inline StateOutputs take_state_outputs(const at::Tensor& scores, const at::Tensor& log_odds,
                                       const at::Tensor& shift) {
  const StateOutputs* lent = lent_state_outputs;
  lent_state_outputs = nullptr;
  const auto fits = [](const at::Tensor& out, const at::Tensor& like, at::ScalarType dtype) {
    return out.defined() && out.device().is_cpu() && out.is_contiguous() &&
           out.scalar_type() == dtype && out.numel() == like.numel();
  };
  const auto apart = [](const at::Tensor& out, std::initializer_list<const at::Tensor*> inputs) {
    for (const at::Tensor* t : inputs) {
      if (out.storage().is_alias_of(t->storage())) return false;
    }
    return true;
  };
  if (lent != nullptr && fits(lent->log_odds, log_odds, log_odds.scalar_type()) &&
      fits(lent->shift, shift, shift.scalar_type()) && fits(lent->nonfinite, shift, at::kBool) &&
      apart(lent->log_odds, {&scores, &log_odds, &shift}) &&
      apart(lent->shift, {&scores, &log_odds, &shift})) {
    return *lent;
  }
  return {empty_output({log_odds.numel()}, log_odds.options()), at::empty_like(shift),
          at::empty({shift.numel()}, shift.options().dtype(at::kBool))};
}

}  // namespace dtp
