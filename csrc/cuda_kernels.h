// The CUDA ops' host code in the .cu files, called by their entry points
// (cuda_entry_points.cpp) once the arguments are checked: these functions throw nothing of
// their own. Only in CUDA builds.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace dtp {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_cuda_kernels(
    const at::Tensor& scores, const at::Tensor& offsets, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds, const at::Tensor& shift_in, int64_t iters,
    bool neutral, int64_t blocks_per_segment, int64_t segment_size);

std::tuple<at::Tensor, at::Tensor> transport_mask_backward_cuda_kernels(
    const at::Tensor& grad_mask, const at::Tensor& scores, const at::Tensor& offsets,
    const at::Tensor& keep, const at::Tensor& eps, const at::Tensor& log_odds,
    const at::Tensor& stats_in, bool neutral, int64_t blocks_per_segment, int64_t segment_size);

// The largest inner size (elements per channel plane) the epilogue's plane kernels take.
int64_t epilogue_cuda_max_inner();

at::Tensor masked_channel_epilogue_cuda_kernels(const at::Tensor& y_in, const at::Tensor& mask,
                                                const c10::optional<at::Tensor>& bias,
                                                c10::string_view activation, int64_t channel_dim);

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_channel_epilogue_backward_cuda_kernels(
    const at::Tensor& grad_out, const at::Tensor& y_in, const at::Tensor& mask,
    const c10::optional<at::Tensor>& bias, c10::string_view activation, int64_t channel_dim);

}  // namespace dtp
