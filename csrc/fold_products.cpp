// DTPPruner's BN fold as one autograd node. In Python the fold is a cat, a multiply and a
// split, whose autograd recording and 66 split views cost a ResNet-50 step more host time
// than the whole mask step; here the node's forward and backward each run three ATen ops
// below autograd.
#include "fold_products.h"

#include <torch/autograd.h>

namespace dtp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Pieces of the flat copy (every weight, then every bias) back in (weight, bias) order.
variable_list interleave(const std::vector<at::Tensor>& pieces) {
  const size_t half = pieces.size() / 2;
  variable_list out(pieces.size());
  for (size_t i = 0; i < half; ++i) {
    out[2 * i] = pieces[i];
    out[2 * i + 1] = pieces[half + i];
  }
  return out;
}

class FoldFunction : public torch::autograd::Function<FoldFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList params, const at::Tensor& mask,
                               const std::optional<at::Tensor>& channels) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const size_t count = params.size();
    std::vector<at::Tensor> ordered;
    std::vector<int64_t> sizes;
    ordered.reserve(count);
    sizes.reserve(count);
    for (size_t start : {0, 1}) {
      for (size_t i = start; i < count; i += 2) {
        ordered.push_back(params[i]);
        sizes.push_back(params[i].numel());
      }
    }
    const at::Tensor flat = at::cat(ordered).view({2, -1});
    const at::Tensor per_channel =
        (channels.has_value() ? mask.index_select(0, *channels) : mask).to(flat.scalar_type());
    const at::Tensor products = (flat * per_channel).view(-1);
    ctx->save_for_backward({flat, per_channel, mask});
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["channels"] = channels.has_value() ? *channels : at::Tensor();
    return interleave(products.split_with_sizes(sizes));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &flat = saved[0], &per_channel = saved[1], &mask = saved[2];
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const at::Tensor channels = ctx->saved_data["channels"].toTensor();
    const size_t count = grads.size(), half = count / 2;
    std::vector<at::Tensor> ordered;  // every weight's gradient, then every bias's
    ordered.reserve(count);
    for (size_t start : {0, 1}) {
      for (size_t i = start; i < count; i += 2) {
        const size_t slot = start == 0 ? i / 2 : half + i / 2;
        ordered.push_back(grads[i].defined() ? grads[i].reshape(-1)
                                             : at::zeros({sizes[slot]}, flat.options()));
      }
    }
    const at::Tensor g = at::cat(ordered).view({2, -1});
    const at::Tensor grad_flat = (g * per_channel).view(-1);
    const at::Tensor grad_channel = (g * flat).sum(0).to(mask.scalar_type());
    const at::Tensor grad_mask = channels.defined()
                                     ? at::zeros_like(mask).index_add_(0, channels, grad_channel)
                                     : grad_channel;
    variable_list out = interleave(grad_flat.split_with_sizes(sizes));
    out.push_back(grad_mask);
    out.push_back(at::Tensor());  // channels
    return out;
  }
};

}  // namespace

std::vector<at::Tensor> fold_products(const std::vector<at::Tensor>& params, const at::Tensor& mask,
                                      const std::optional<at::Tensor>& channels) {
  TORCH_CHECK(params.size() % 2 == 0 && !params.empty(),
              "fold_products: params must be (weight, bias) pairs, got ", params.size());
  for (size_t i = 0; i < params.size(); i += 2) {
    TORCH_CHECK(params[i].dim() == 1 && params[i].sizes() == params[i + 1].sizes(),
                "fold_products: pair ", i / 2, " must be two 1-D tensors of one size");
  }
  return FoldFunction::apply(at::TensorList(params), mask, channels);
}

}  // namespace dtp
