// Autograd of dtp::transport_mask, for every device: a torch::autograd::Function whose
// forward and backward call the device kernels through the dispatcher. Written in C++
// because a Python autograd registration costs more per step than the kernels of a whole
// ResNet-50 (see benchmarks/README.md); torch.compile and opcheck see the same op.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace dtp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using ForwardSig = Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
                           int64_t, int64_t);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, bool, int64_t, int64_t,
                                                       const std::optional<at::Tensor>&);

class TransportMaskFunction : public torch::autograd::Function<TransportMaskFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& scores,
                               const at::Tensor& offsets, const at::Tensor& keep,
                               const at::Tensor& eps, const at::Tensor& log_odds,
                               const at::Tensor& shift, int64_t iters, bool neutral_nonfinite,
                               int64_t blocks_per_segment, int64_t segment_size) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dtp::transport_mask", "")
                         .typed<ForwardSig>();
    auto [mask, new_log_odds, new_shift, stats, nonfinite] =
        op.call(scores, offsets, keep, eps, log_odds, shift, iters, neutral_nonfinite,
                blocks_per_segment, segment_size);
    // The mask is saved too: the general CPU kernels form a one-iteration step's terms
    // from it (no exp per element). Like any saved output, changing it in place makes
    // backward raise.
    ctx->save_for_backward({scores, offsets, keep, eps, log_odds, stats, mask});
    ctx->saved_data["neutral_nonfinite"] = neutral_nonfinite;
    ctx->saved_data["blocks_per_segment"] = blocks_per_segment;
    ctx->saved_data["segment_size"] = segment_size;
    ctx->mark_non_differentiable({new_log_odds, new_shift, stats, nonfinite});
    // Only the mask has a gradient: without this the engine would fill a zero tensor for
    // each of the four other outputs on every backward.
    ctx->set_materialize_grads(false);
    return {mask, new_log_odds, new_shift, stats, nonfinite};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dtp::transport_mask_backward", "")
                         .typed<BackwardSig>();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor grad_mask = grads[0].defined() ? grads[0] : at::zeros_like(saved[0]);
    auto [grad_scores, grad_keep] =
        op.call(grad_mask, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5],
                ctx->saved_data["neutral_nonfinite"].toBool(),
                ctx->saved_data["blocks_per_segment"].toInt(),
                ctx->saved_data["segment_size"].toInt(), saved[6]);
    return {grad_scores,  at::Tensor(), grad_keep,    at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

Outputs transport_mask_autograd(const at::Tensor& scores, const at::Tensor& offsets,
                                const at::Tensor& keep, const at::Tensor& eps,
                                const at::Tensor& log_odds, const at::Tensor& shift, int64_t iters,
                                bool neutral_nonfinite, int64_t blocks_per_segment,
                                int64_t segment_size) {
  auto out = TransportMaskFunction::apply(scores, offsets, keep, eps, log_odds, shift, iters,
                                          neutral_nonfinite, blocks_per_segment, segment_size);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

TORCH_LIBRARY_IMPL(dtp, Autograd, m) { m.impl("transport_mask", &transport_mask_autograd); }

}  // namespace dtp
