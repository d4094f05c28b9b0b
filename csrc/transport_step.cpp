// The eager per-step entry of transport_mask: one call from Python runs dtp::transport_mask
// through the dispatcher (its autograd included) and writes the next state into the
// TransportState's pending buffers, so a training step pays one Python-to-C++ crossing and
// no Python tensor wrappers for the four state outputs. torch.compile keeps calling the
// functional op (dtp_kernels/transport_mask.py); this entry is only for eager calls.
#include "transport_step.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cstring>
#include <utility>

#include "lent_state_outputs.h"

namespace dtp {

at::Tensor transport_mask_step(const at::Tensor& scores, const at::Tensor& offsets,
                               const at::Tensor& keep, const at::Tensor& eps,
                               const at::Tensor& log_odds, const at::Tensor& shift, int64_t iters,
                               bool neutral_nonfinite, int64_t blocks_per_segment,
                               int64_t segment_size, at::Tensor pending_log_odds,
                               at::Tensor pending_shift, at::Tensor pending_nonfinite,
                               at::Tensor has_pending) {
  using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dtp::transport_mask", "")
          .typed<Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, int64_t, bool, int64_t, int64_t)>();
  // The kernel (CPU or CUDA) writes the next state straight into the pending buffers when
  // they fit (csrc/lent_state_outputs.h); otherwise (float64 scores on a float32 state, or
  // a backend without the lending) the op returns new tensors and they are copied.
  const StateOutputs lent{pending_log_odds, pending_shift, pending_nonfinite};
  Outputs outputs;
  {
    LendStateOutputs lend(&lent);
    outputs = op.call(scores, offsets, keep, eps, log_odds, shift, iters, neutral_nonfinite,
                      blocks_per_segment, segment_size);
  }
  auto& [mask, new_log_odds, new_shift, stats, nonfinite] = outputs;
  // The state outputs carry no gradient; the copies are not part of the graph.
  at::NoGradGuard no_grad;
  for (auto [target, result] :
       {std::pair{&pending_log_odds, &new_log_odds}, std::pair{&pending_shift, &new_shift},
        std::pair{&pending_nonfinite, &nonfinite}}) {
    if (result->is_same(*target)) {
      target->unsafeGetTensorImpl()->bump_version();  // written in place, as copy_ would
    } else {
      target->copy_(*result);  // copy_ converts float64 results for a float32 state
    }
  }
  if (has_pending.device().is_cpu() && has_pending.scalar_type() == at::kBool &&
      has_pending.numel() == 1) {
    *has_pending.data_ptr<bool>() = true;  // a flag on the host: no op dispatched for it
    has_pending.unsafeGetTensorImpl()->bump_version();
  } else {
    has_pending.fill_(true);
  }
  return mask;
}

namespace {

// Contiguous, of `dtype`, on `device`: buffers the plain loops and the CUDA kernel take.
bool plain(const at::Tensor& t, at::ScalarType dtype, const at::Device& device) {
  return t.device() == device && t.is_contiguous() && t.scalar_type() == dtype;
}

}  // namespace

void transport_commit(at::Tensor log_odds, at::Tensor shift, const at::Tensor& pending_log_odds,
                      const at::Tensor& pending_shift, at::Tensor steps, at::Tensor skipped_steps,
                      at::Tensor has_pending, at::Tensor pending_nonfinite) {
  at::NoGradGuard no_grad;
  const auto acc = log_odds.scalar_type();
  const auto device = log_odds.device();
  const int64_t nseg = shift.numel();
  const bool plain_buffers =
      (acc == at::kFloat || acc == at::kDouble) && plain(log_odds, acc, device) &&
      plain(pending_log_odds, acc, device) && plain(shift, acc, device) &&
      plain(pending_shift, acc, device) && plain(steps, at::kLong, device) &&
      plain(skipped_steps, at::kLong, device) && plain(has_pending, at::kBool, device) &&
      plain(pending_nonfinite, at::kBool, device) && pending_log_odds.numel() == log_odds.numel() &&
      pending_shift.numel() == nseg && skipped_steps.numel() == nseg &&
      pending_nonfinite.numel() == nseg && steps.numel() == 1 && has_pending.numel() == 1;
  if (plain_buffers && device.is_cpu()) {
    // CPU: the same in plain loops (these are the state's own small buffers; the
    // dispatcher's per-op cost would be most of the time)
    std::memcpy(log_odds.data_ptr(), pending_log_odds.data_ptr(), log_odds.nbytes());
    std::memcpy(shift.data_ptr(), pending_shift.data_ptr(), shift.nbytes());
    bool* pending = has_pending.data_ptr<bool>();
    bool* held = pending_nonfinite.data_ptr<bool>();
    int64_t* skipped = skipped_steps.data_ptr<int64_t>();
    *steps.data_ptr<int64_t>() += *pending ? 1 : 0;
    // Held segments are rare (NaN/Inf scores): find them (memchr) rather than read and
    // write every segment's count, 18 bytes per segment (4.5 per weight in 2:4).
    static_assert(sizeof(bool) == 1, "flags are bytes");
    for (int64_t s = 0; s < nseg;) {
      const void* found = std::memchr(held + s, 1, static_cast<size_t>(nseg - s));
      if (found == nullptr) break;
      s = static_cast<const bool*>(found) - held;
      skipped[s] += 1;
      held[s++] = false;
    }
    *pending = false;
#ifdef DTP_WITH_CUDA
  } else if (plain_buffers && device.is_cuda()) {  // one launch, no host sync
    transport_commit_cuda(log_odds, shift, pending_log_odds, pending_shift, steps, skipped_steps,
                          has_pending, pending_nonfinite);
#endif
  } else {  // anything else (strided views, mixed devices): four torch ops, no host sync
    at::_foreach_copy_({log_odds, shift}, {pending_log_odds, pending_shift});
    steps.add_(has_pending);
    skipped_steps.add_(pending_nonfinite);
    at::_foreach_zero_({has_pending, pending_nonfinite});
    return;
  }
  // Raw writes skip the version counters that in-place ops bump, and autograd reads them:
  // a backward after a commit must fail as it does after the torch ops ("modified by an
  // inplace operation"), not run on the new state.
  for (const at::Tensor* t :
       {&log_odds, &shift, &steps, &skipped_steps, &has_pending, &pending_nonfinite}) {
    t->unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace dtp
