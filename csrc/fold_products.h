// DTPPruner's BN fold in one C++ autograd node: every masked BN weight and bias times its
// channels' mask (dtp_kernels/pruning/masking.py, folded_products, is the same in Python).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace dtp {

// params: (weight, bias) pairs, one per BN, each of its channel count; mask: the flat mask
// of all groups; channels: the flat mask's entry of each pair's channel, in pair order
// (nullopt: the pairs cover the whole mask in order). Returns params[i] * its mask, views
// of one product tensor, differentiable in the parameters and the mask.
std::vector<at::Tensor> fold_products(const std::vector<at::Tensor>& params, const at::Tensor& mask,
                                      const std::optional<at::Tensor>& channels);

}  // namespace dtp
