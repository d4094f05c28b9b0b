// Autograd of dtp::masked_channel_epilogue for every device: the forward calls the device
// kernel through the dispatcher below autograd and records one backward node (a Node
// subclass, for the reasons in transport_mask_autograd.cpp), whose apply calls
// dtp::masked_channel_epilogue_backward the same way.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <mutex>
#include <string>

#include "autograd_node.h"

namespace dtp {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, c10::string_view, int64_t);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
                                                                   const at::Tensor&,
                                                                   const at::Tensor&,
                                                                   const c10::optional<at::Tensor>&,
                                                                   c10::string_view, int64_t);

// Edges: y, mask and, when given, bias.
struct MaskedEpilogueBackward : public torch::autograd::Node {
  SavedVariable y, mask, bias;
  bool has_bias = false;
  std::string activation;
  int64_t channel_dim = 0;

  std::string name() const override { return "dtp::MaskedChannelEpilogueBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    y.reset_data();
    mask.reset_data();
    bias.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dtp::masked_channel_epilogue_backward", "")
                         .typed<BackwardSig>();
    const at::Tensor y_saved = y.unpack();
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(y_saved);
    const c10::optional<at::Tensor> b =
        has_bias ? c10::optional<at::Tensor>(bias.unpack()) : c10::nullopt;
    auto [grad_y, grad_mask, grad_bias] =
        op.call(grad_out, y_saved, mask.unpack(), b, activation, channel_dim);
    variable_list out{should_compute_output(0) ? grad_y : at::Tensor(),
                      should_compute_output(1) ? grad_mask : at::Tensor()};
    if (has_bias) out.push_back(should_compute_output(2) ? grad_bias : at::Tensor());
    return out;
  }
};

at::Tensor masked_channel_epilogue_autograd(const at::Tensor& y, const at::Tensor& mask,
                                            const c10::optional<at::Tensor>& bias,
                                            c10::string_view activation, int64_t channel_dim) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dtp::masked_channel_epilogue", "")
                       .typed<ForwardSig>();
  // No forward-mode formula: a tangent would be dropped without a word.
  TORCH_CHECK(!torch::autograd::isFwGradDefined(y) && !torch::autograd::isFwGradDefined(mask) &&
                  !torch::autograd::isFwGradDefined(bias),
              "dtp::masked_channel_epilogue: forward-mode AD (dual tensors, torch.func.jvp) is "
              "not supported; its gradient is available in reverse mode");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(y, mask, bias, activation, channel_dim);
  }
  const at::Tensor no_bias;
  const at::Tensor& b = bias.has_value() ? *bias : no_bias;
  if (torch::autograd::compute_requires_grad(y, mask, b)) {
    auto node = make_node<MaskedEpilogueBackward>();
    node->set_next_edges(bias.has_value() ? torch::autograd::collect_next_edges(y, mask, b)
                                          : torch::autograd::collect_next_edges(y, mask));
    node->y = SavedVariable(y, false);
    node->mask = SavedVariable(mask, false);
    if (bias.has_value()) node->bias = SavedVariable(*bias, false);
    node->has_bias = bias.has_value();
    node->activation = std::string(activation);
    node->channel_dim = channel_dim;
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dtp, Autograd, m) {
  m.impl("masked_channel_epilogue", &masked_channel_epilogue_autograd);
}

}  // namespace dtp
