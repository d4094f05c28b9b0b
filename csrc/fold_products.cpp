// DTPPruner's BN fold as one autograd node. In Python the fold is a cat, a multiply and a
// split, whose autograd recording and 66 split views cost a ResNet-50 step more host time
// than the whole mask step; here the node's forward and backward each run three ATen ops
// below autograd. The node is written directly (a Node subclass, as torch's generated
// backward functions are) rather than as a torch::autograd::Function: with 67 inputs and
// 66 outputs, Function's per-input and per-output bookkeeping (VariableInfo of each, the
// view and dirty checks, a context map) was most of the fold's host time.
#include "fold_products.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "autograd_node.h"

namespace dtp {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// A tensor of ATen's own: no Python subclass or mode, functionalization or functorch
// wrapper sees it, so its pieces may be built directly.
bool plain(const at::Tensor& t) {
  constexpr c10::DispatchKeySet wrapped(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
       c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
       c10::DispatchKey::FuncTorchGradWrapper});
  return !t.key_set().has_any(wrapped) &&
         !c10::impl::tls_local_dispatch_key_set().included_.has_any(wrapped) && t.is_contiguous() &&
         t.dim() == 1;
}

// The pieces of a 1-D tensor, of sizes[i] elements each. For a plain tensor they are
// built on its storage directly: split's slices cost a dispatch and a view each, and the
// fold's outputs need not be views (each is a fresh result that nothing writes to).
std::vector<at::Tensor> pieces(const at::Tensor& whole, const std::vector<int64_t>& sizes) {
  if (!plain(whole)) return whole.split_with_sizes(sizes);
  std::vector<at::Tensor> out;
  out.reserve(sizes.size());
  int64_t offset = whole.storage_offset();
  for (const int64_t n : sizes) {
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::TensorImpl::VIEW, c10::Storage(whole.storage()), whole.key_set(), whole.dtype());
    impl->set_storage_offset(offset);
    impl->set_sizes_contiguous({n});
    out.emplace_back(std::move(impl));
    offset += n;
  }
  return out;
}

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

// Backward of the fold. Its inputs are the 2P products' gradients; its outputs, in edge
// order, the gradients of the 2P parameters and then of the mask.
struct FoldBackward : public torch::autograd::Node {
  SavedVariable flat;         // [2, C]: every weight, then every bias
  SavedVariable per_channel;  // [C]: each channel's mask entry
  SavedVariable mask;         // the flat mask (for its dtype and size)
  std::vector<int64_t> sizes;
  at::Tensor channels;  // an index, no gradient; undefined: the pairs cover the mask in order

  std::string name() const override { return "dtp::FoldProductsBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    flat.reset_data();
    per_channel.reset_data();
    mask.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor f = flat.unpack(), pc = per_channel.unpack(), m = mask.unpack();
    const size_t count = grads.size(), half = count / 2;
    std::vector<at::Tensor> ordered;  // every weight's gradient, then every bias's
    ordered.reserve(count);
    for (size_t start : {0, 1}) {
      for (size_t i = start; i < count; i += 2) {
        const size_t slot = start == 0 ? i / 2 : half + i / 2;
        // The parameters are 1-D, and so are their gradients: reshape only what is not
        // (a dispatch each, 66 times per ResNet-50 step).
        const at::Tensor& grad = grads[i];
        ordered.push_back(!grad.defined()   ? at::zeros({sizes[slot]}, f.options())
                          : grad.dim() == 1 ? grad
                                            : grad.reshape(-1));
      }
    }
    const at::Tensor g = at::cat(ordered).view({2, -1});
    variable_list out(count + 1);
    bool params_needed = false;
    for (size_t i = 0; i < count; ++i) params_needed = params_needed || should_compute_output(i);
    if (params_needed) {
      out = interleave(pieces((g * pc).view(-1), sizes));
      out.emplace_back();
    }
    if (should_compute_output(count)) {
      at::Tensor grad_channel = (g * f).sum(0);
      if (grad_channel.scalar_type() != m.scalar_type())
        grad_channel = grad_channel.to(m.scalar_type());
      out[count] = channels.defined() ? at::zeros_like(m).index_add_(0, channels, grad_channel)
                                      : grad_channel;
    }
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
  // No forward-mode formula: a tangent would be dropped without a word.
  TORCH_CHECK(
      !torch::autograd::isFwGradDefined(mask) &&
          std::none_of(params.begin(), params.end(),
                       [](const at::Tensor& p) { return torch::autograd::isFwGradDefined(p); }),
      "fold_products: forward-mode AD (dual tensors) is not supported");
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
  at::Tensor flat, per_channel;
  variable_list outputs;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    flat = at::cat(ordered).view({2, -1});
    per_channel = channels.has_value() ? mask.index_select(0, *channels) : mask;
    if (per_channel.scalar_type() != flat.scalar_type())
      per_channel = per_channel.to(flat.scalar_type());
    outputs = interleave(pieces((flat * per_channel).view(-1), sizes));
  }
  if (torch::autograd::compute_requires_grad(params, mask)) {
    auto node = make_node<FoldBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(params, mask));
    node->flat = SavedVariable(flat, false);
    node->per_channel = SavedVariable(per_channel, false);
    node->mask = SavedVariable(mask, false);
    node->sizes = std::move(sizes);
    if (channels.has_value()) node->channels = *channels;
    torch::autograd::set_history(outputs, node);
  }
  return outputs;
}

}  // namespace dtp
