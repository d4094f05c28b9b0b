// The CUDA ops as the dispatcher calls them: every argument check, then the kernels' host
// code in the .cu files (cuda_kernels.h). The errors are thrown here, in code the C++
// compiler built: on an H200 with torch 2.11 (2026-12-04) an error thrown from host code
// that nvcc built ended the process with SIGSEGV, while one thrown from a .cpp file was
// raised as a RuntimeError (tests/ops/test_op_errors.py checks it in child processes).
#ifdef DTP_WITH_CUDA

#include <torch/library.h>

#include <initializer_list>

#include "common.h"
#include "cuda_kernels.h"

namespace dtp {
namespace {

void check_devices(const at::Tensor& scores, std::initializer_list<const at::Tensor*> others) {
  for (const auto* t : others) {
    TORCH_CHECK(t->device() == scores.device(),
                "dtp::transport_mask: all tensors must be on the scores' device (", scores.device(),
                "), got one on ", t->device());
  }
}

// The checks both directions make before anything is read or converted.
void check_inputs(const at::Tensor& scores, const at::Tensor& offsets, const at::Tensor& keep,
                  const at::Tensor& eps, const at::Tensor& log_odds, int64_t requested_blocks,
                  int64_t segment_size) {
  check_blocks_per_segment(requested_blocks);
  check_transport_args(scores, offsets, keep, eps, log_odds);
  check_devices(scores, {&offsets, &keep, &eps, &log_odds});
  check_segment_size(segment_size, scores, offsets);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_cuda(
    const at::Tensor& scores, const at::Tensor& offsets, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds, const at::Tensor& shift, int64_t iters,
    bool neutral, int64_t blocks_per_segment, int64_t segment_size) {
  TORCH_CHECK(iters >= 1, "dtp::transport_mask: iters must be >= 1, got ", iters);
  check_inputs(scores, offsets, keep, eps, log_odds, blocks_per_segment, segment_size);
  check_devices(scores, {&shift});
  const int64_t nseg = offsets.numel() - 1;
  TORCH_CHECK(shift.scalar_type() == acc_type(scores) && shift.numel() == nseg,
              "dtp::transport_mask: shift must be ", acc_type(scores),
              " with one entry per segment (", nseg, ")");
  return transport_mask_cuda_kernels(scores, offsets, keep, eps, log_odds, shift, iters, neutral,
                                     blocks_per_segment, segment_size);
}

std::tuple<at::Tensor, at::Tensor> transport_mask_backward_cuda(
    const at::Tensor& grad_mask, const at::Tensor& scores, const at::Tensor& offsets,
    const at::Tensor& keep, const at::Tensor& eps, const at::Tensor& log_odds,
    const at::Tensor& stats, bool neutral, int64_t blocks_per_segment, int64_t segment_size,
    const std::optional<at::Tensor>& /*mask: the CUDA kernels recompute p and q*/) {
  check_inputs(scores, offsets, keep, eps, log_odds, blocks_per_segment, segment_size);
  check_stats(stats, scores, offsets.numel() - 1,
              use_blocks_kernels(segment_size, blocks_per_segment));
  TORCH_CHECK(grad_mask.numel() == scores.numel(), "dtp::transport_mask_backward: grad_mask has ",
              grad_mask.numel(), " elements, expected ", scores.numel());
  return transport_mask_backward_cuda_kernels(grad_mask, scores, offsets, keep, eps, log_odds,
                                              stats, neutral, blocks_per_segment, segment_size);
}

// The epilogue's arguments: its activation, y's channel dim, the per-channel vectors, and
// a plane small enough for the plane kernels' grid.
void check_epilogue(const at::Tensor& y, const at::Tensor& mask,
                    const c10::optional<at::Tensor>& bias, c10::string_view activation,
                    int64_t channel_dim) {
  parse_activation(activation);
  const int64_t cd = epilogue_channel_dim(y, channel_dim);
  const int64_t channels = y.size(cd);
  check_channel_vector(mask, channels, "mask");
  if (bias) check_channel_vector(*bias, channels, "bias");
  int64_t inner = 1;  // a plane's elements, unless channels-last rows are read
  for (int64_t d = cd + 1; d < y.dim(); ++d) inner *= y.size(d);
  TORCH_CHECK(epilogue_channels_last(y, cd) || inner <= epilogue_cuda_max_inner(),
              "dtp::masked_channel_epilogue: inner size ", inner,
              " is too large for the CUDA kernel (at most ", epilogue_cuda_max_inner(), ")");
}

at::Tensor masked_channel_epilogue_cuda(const at::Tensor& y, const at::Tensor& mask,
                                        const c10::optional<at::Tensor>& bias,
                                        c10::string_view activation, int64_t channel_dim) {
  check_epilogue(y, mask, bias, activation, channel_dim);
  return masked_channel_epilogue_cuda_kernels(y, mask, bias, activation, channel_dim);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_channel_epilogue_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& mask,
    const c10::optional<at::Tensor>& bias, c10::string_view activation, int64_t channel_dim) {
  TORCH_CHECK(grad_out.sizes() == y.sizes(),
              "dtp::masked_channel_epilogue_backward: grad_out has shape ", grad_out.sizes(),
              ", y has ", y.sizes());
  check_epilogue(y, mask, bias, activation, channel_dim);
  return masked_channel_epilogue_backward_cuda_kernels(grad_out, y, mask, bias, activation,
                                                       channel_dim);
}

}  // namespace

TORCH_LIBRARY_IMPL(dtp, CUDA, m) {
  m.impl("transport_mask", &transport_mask_cuda);
  m.impl("transport_mask_backward", &transport_mask_backward_cuda);
  m.impl("masked_channel_epilogue", &masked_channel_epilogue_cuda);
  m.impl("masked_channel_epilogue_backward", &masked_channel_epilogue_backward_cuda);
}

}  // namespace dtp

#endif  // DTP_WITH_CUDA
