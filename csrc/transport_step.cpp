// The eager per-step entry of transport_mask: one call from Python runs dtp::transport_mask
// through the dispatcher (its autograd included) and writes the next state into the
// TransportState's pending buffers, so a training step pays one Python-to-C++ crossing and
// no Python tensor wrappers for the four state outputs. torch.compile keeps calling the
// functional op (dtp_kernels/transport_mask.py); this entry is only for eager calls.
#include "transport_step.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

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
  auto [mask, new_log_odds, new_shift, stats, nonfinite] =
      op.call(scores, offsets, keep, eps, log_odds, shift, iters, neutral_nonfinite,
              blocks_per_segment, segment_size);
  // The state outputs carry no gradient; the copies are not part of the graph.
  at::NoGradGuard no_grad;
  pending_log_odds.copy_(new_log_odds);  // copy_ converts float64 results for a float32 state
  pending_shift.copy_(new_shift);
  pending_nonfinite.copy_(nonfinite);
  has_pending.fill_(true);
  return mask;
}

}  // namespace dtp
