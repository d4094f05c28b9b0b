// Autograd of dtp::transport_mask, for every device: the forward calls the device kernel
// through the dispatcher below autograd and records one backward node, whose apply calls
// dtp::transport_mask_backward the same way. Written in C++ because a Python autograd
// registration costs more per step than the kernels of a whole ResNet-50 (see
// docs/benchmarks.md), and as a Node subclass, as torch's generated backward functions
// are, rather than a torch::autograd::Function, whose per-input and per-output
// bookkeeping (ten inputs, five outputs, a context map) cost more than the node itself.
// torch.compile and opcheck see the same op.
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

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using ForwardSig = Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
                           int64_t, int64_t);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, bool, int64_t, int64_t,
                                                       const std::optional<at::Tensor>&);

// The backward of the mask, the op's one differentiable output; its edges are the scores
// and the kept counts (which learn under a FLOPs budget).
struct TransportMaskBackward : public torch::autograd::Node {
  SavedVariable scores, offsets, keep, eps, log_odds, stats;
  // The general CPU kernels form a one-iteration step's terms from the mask (no exp per
  // element). Like any saved output, changing it in place makes backward raise.
  SavedVariable mask;
  bool neutral_nonfinite = false;
  int64_t blocks_per_segment = 0;
  int64_t segment_size = 0;

  std::string name() const override { return "dtp::TransportMaskBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&scores, &offsets, &keep, &eps, &log_odds, &stats, &mask}) {
      v->reset_data();
    }
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dtp::transport_mask_backward", "")
                         .typed<BackwardSig>();
    const at::Tensor s = scores.unpack();
    const at::Tensor m = mask.unpack(getptr());
    const at::Tensor grad_mask = grads[0].defined() ? grads[0] : at::zeros_like(s);
    auto [grad_scores, grad_keep] =
        op.call(grad_mask, s, offsets.unpack(), keep.unpack(), eps.unpack(), log_odds.unpack(),
                stats.unpack(), neutral_nonfinite, blocks_per_segment, segment_size, m);
    return {should_compute_output(0) ? grad_scores : at::Tensor(),
            should_compute_output(1) ? grad_keep : at::Tensor()};
  }
};

Outputs transport_mask_autograd(const at::Tensor& scores, const at::Tensor& offsets,
                                const at::Tensor& keep, const at::Tensor& eps,
                                const at::Tensor& log_odds, const at::Tensor& shift, int64_t iters,
                                bool neutral_nonfinite, int64_t blocks_per_segment,
                                int64_t segment_size) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("dtp::transport_mask", "").typed<ForwardSig>();
  // No forward-mode formula: a tangent would be dropped without a word.
  TORCH_CHECK(!torch::autograd::isFwGradDefined(scores) && !torch::autograd::isFwGradDefined(keep),
              "dtp::transport_mask: forward-mode AD (dual tensors, torch.func.jvp) is not "
              "supported; its gradient is available in reverse mode");
  Outputs outputs;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    outputs = op.call(scores, offsets, keep, eps, log_odds, shift, iters, neutral_nonfinite,
                      blocks_per_segment, segment_size);
  }
  // Only the mask is differentiable; the next state, the stats and the flags carry no
  // gradient and get no history.
  if (torch::autograd::compute_requires_grad(scores, keep)) {
    const at::Tensor& mask = std::get<0>(outputs);
    auto node = make_node<TransportMaskBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(scores, keep));
    node->scores = SavedVariable(scores, false);
    node->offsets = SavedVariable(offsets, false);
    node->keep = SavedVariable(keep, false);
    node->eps = SavedVariable(eps, false);
    node->log_odds = SavedVariable(log_odds, false);
    node->stats = SavedVariable(std::get<3>(outputs), false);
    node->neutral_nonfinite = neutral_nonfinite;
    node->blocks_per_segment = blocks_per_segment;
    node->segment_size = segment_size;
    torch::autograd::set_history(mask, node);
    node->mask = SavedVariable(mask, true);
  }
  return outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(dtp, Autograd, m) { m.impl("transport_mask", &transport_mask_autograd); }

}  // namespace dtp
