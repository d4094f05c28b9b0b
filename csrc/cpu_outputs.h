// Large outputs of the CPU kernels: blocks of memory kept for reuse after their tensors
// are freed (cpu_output_cache.cpp), so a step does not map and zero fresh pages for them
// every call, and new blocks backed by transparent huge pages where Linux offers them
// (madvise(MADV_HUGEPAGE) before the first write: 512 times fewer faults, as torch asks
// for all its allocations under THP_MEM_ALLOC_ENABLE=1).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>

#include "cpu_output_cache.h"

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
