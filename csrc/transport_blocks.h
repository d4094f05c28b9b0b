// The transport-mask step for segments of one small size M (4, 8 or 16): entry points of
// transport_mask_blocks_cpu.cpp, which dtp::transport_mask's CPU kernels call when their
// segment_size argument is M.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace dtp {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_blocks_cpu(
    const at::Tensor& scores, const at::Tensor& keep, const at::Tensor& eps,
    const at::Tensor& log_odds, const at::Tensor& shift, int64_t iters, bool neutral_nonfinite,
    int64_t segment_size);

std::tuple<at::Tensor, at::Tensor> transport_mask_blocks_backward_cpu(
    const at::Tensor& grad_mask, const at::Tensor& scores, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds, const at::Tensor& stats,
    bool neutral_nonfinite, int64_t segment_size);

}  // namespace dtp
