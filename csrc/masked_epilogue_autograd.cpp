// Autograd of dtp::masked_channel_epilogue for every device: forward and backward call the
// device kernels through the dispatcher (same reasons as transport_mask_autograd.cpp).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>

namespace dtp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, c10::string_view, int64_t);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
                                                                   const at::Tensor&,
                                                                   const at::Tensor&,
                                                                   const c10::optional<at::Tensor>&,
                                                                   c10::string_view, int64_t);

class MaskedEpilogueFunction : public torch::autograd::Function<MaskedEpilogueFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& mask,
                               const c10::optional<at::Tensor>& bias, c10::string_view activation,
                               int64_t channel_dim) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dtp::masked_channel_epilogue", "")
                         .typed<ForwardSig>();
    auto out = op.call(y, mask, bias, activation, channel_dim);
    ctx->save_for_backward({y, mask, bias.value_or(at::Tensor())});
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["channel_dim"] = channel_dim;
    ctx->saved_data["has_bias"] = bias.has_value();
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dtp::masked_channel_epilogue_backward", "")
                         .typed<BackwardSig>();
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const c10::optional<at::Tensor> bias =
        has_bias ? c10::optional<at::Tensor>(saved[2]) : c10::nullopt;
    auto [grad_y, grad_mask, grad_bias] = op.call(grads[0], saved[0], saved[1], bias, activation,
                                                  ctx->saved_data["channel_dim"].toInt());
    return {grad_y, grad_mask, has_bias ? grad_bias : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor masked_channel_epilogue_autograd(const at::Tensor& y, const at::Tensor& mask,
                                            const c10::optional<at::Tensor>& bias,
                                            c10::string_view activation, int64_t channel_dim) {
  return MaskedEpilogueFunction::apply(y, mask, bias, activation, channel_dim)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(dtp, Autograd, m) {
  m.impl("masked_channel_epilogue", &masked_channel_epilogue_autograd);
}

}  // namespace dtp
