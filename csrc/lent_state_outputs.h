// TransportState's pending buffers, lent by the eager step entry (transport_step.cpp) to
// the kernel of dtp::transport_mask it calls, CPU or CUDA, which writes the next log-odds,
// shift and non-finite flags straight into them: no state-sized allocation and no copy
// afterwards (on a GPU, three allocations and three copy launches fewer per step).
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <optional>
#include <utility>

namespace dtp {

struct StateOutputs {
  at::Tensor log_odds, shift, nonfinite;
};

// The buffers lent to the next kernel on this thread (null: none). The kernel takes them
// at most once (take_lent_state_outputs), so an op nested inside cannot write them too.
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

// The lent buffers when they fit the kernel's outputs exactly (contiguous tensors on the
// state's device, of its dtype and sizes, none aliasing an input); else nullopt, and the
// kernel allocates its own. Either way nothing stays lent.
inline std::optional<StateOutputs> take_lent_state_outputs(const at::Tensor& scores,
                                                           const at::Tensor& log_odds,
                                                           const at::Tensor& shift) {
  const StateOutputs* lent = lent_state_outputs;
  lent_state_outputs = nullptr;
  if (lent == nullptr) return std::nullopt;
  const auto fits = [&](const at::Tensor& out, const at::Tensor& like, at::ScalarType dtype) {
    return out.defined() && out.device() == log_odds.device() && out.is_contiguous() &&
           out.scalar_type() == dtype && out.numel() == like.numel();
  };
  const auto apart = [](const at::Tensor& out, std::initializer_list<const at::Tensor*> inputs) {
    for (const at::Tensor* t : inputs) {
      if (out.storage().is_alias_of(t->storage())) return false;
    }
    return true;
  };
  if (fits(lent->log_odds, log_odds, log_odds.scalar_type()) &&
      fits(lent->shift, shift, shift.scalar_type()) && fits(lent->nonfinite, shift, at::kBool) &&
      apart(lent->log_odds, {&scores, &log_odds, &shift}) &&
      apart(lent->shift, {&scores, &log_odds, &shift})) {
    return *lent;
  }
  return std::nullopt;
}

// The lent buffers, or fresh ones from at::empty (the CUDA kernels' outputs; the CPU
// kernels take fresh ones from their output cache, cpu_outputs.h).
inline StateOutputs lent_or_empty_state_outputs(const at::Tensor& scores,
                                                const at::Tensor& log_odds,
                                                const at::Tensor& shift) {
  if (auto lent = take_lent_state_outputs(scores, log_odds, shift)) return *std::move(lent);
  return {at::empty_like(log_odds), at::empty_like(shift),
          at::empty({shift.numel()}, shift.options().dtype(at::kBool))};
}

}  // namespace dtp
