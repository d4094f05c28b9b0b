// CUDA kernels of the DTP transport-mask step for segments that all have one small size M
// (4, 8 or 16): the blocks of N:M sparsity. One thread per segment runs the step of
// transport_blocks_tile.h on a tile of one segment (its M elements in registers): no
// offsets are read, no block reductions, no shared memory. The CPU kernels run the same
// code on tiles of 32 or 16 segments, so the two agree up to rounding (the device's expf/logf
// against the CPU's polynomials, and which sums a tile takes) and each is bitwise
// reproducible. dtp::transport_mask's CUDA kernels (transport_mask_cuda.cu) call these
// when their segment_size argument is M and blocks_per_segment does not force a schedule.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <type_traits>

#include "common.h"
#include "lent_state_outputs.h"
#include "transport_blocks.h"
#include "transport_blocks_tile.h"

namespace dtp {
namespace {

constexpr int kThreads = 256;

template <int M, class scalar_t, class T>
__global__ void __launch_bounds__(kThreads)
    blocks_forward_kernel(const blocks::BlocksForwardArgs a, int64_t nseg) {
  const int64_t seg = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (seg < nseg) blocks::forward_tile<M, 1, scalar_t, T>(a, seg);
}

template <int M, class scalar_t, class T>
__global__ void __launch_bounds__(kThreads)
    blocks_backward_kernel(const blocks::BlocksBackwardArgs a, int64_t nseg) {
  const int64_t seg = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (seg < nseg) blocks::backward_tile<M, 1, scalar_t, T>(a, seg);
}

// One thread per segment, on the current stream; nothing to launch without segments.
template <int M, class scalar_t, class T, class Args>
void launch(const Args& a, int64_t nseg) {
  if (nseg == 0) return;
  const int64_t grid = (nseg + kThreads - 1) / kThreads;
  auto stream = at::cuda::getCurrentCUDAStream();
  if constexpr (std::is_same_v<Args, blocks::BlocksForwardArgs>) {
    blocks_forward_kernel<M, scalar_t, T><<<grid, kThreads, 0, stream>>>(a, nseg);
  } else {
    blocks_backward_kernel<M, scalar_t, T><<<grid, kThreads, 0, stream>>>(a, nseg);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernels for the scores' dtype and M (4, 8 or 16, checked by the caller).
template <class Args>
void run_blocks(const Args& a, int64_t nseg, int64_t m, at::ScalarType dtype) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, dtype, "transport_mask_blocks_cuda", [&] {
        using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        with_segment_size(m,
                          [&](auto size) { launch<decltype(size)::value, scalar_t, T>(a, nseg); });
      });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_blocks_cuda(
    const at::Tensor& scores_in, const at::Tensor& keep_in, const at::Tensor& eps_in,
    const at::Tensor& log_odds_in, const at::Tensor& shift_in, int64_t iters,
    bool neutral_nonfinite, int64_t m) {
  const c10::cuda::CUDAGuard guard(scores_in.device());
  const int64_t nseg = keep_in.numel();
  const BlocksInputs in = blocks_inputs(scores_in, keep_in, eps_in, log_odds_in);
  const at::Tensor &scores = in.scores, &log_odds = in.log_odds;
  const auto shift = shift_in.contiguous();
  auto mask_acc = at::empty({scores.numel()}, log_odds.options());
  const StateOutputs next = lent_or_empty_state_outputs(scores, log_odds, shift);
  const at::Tensor &new_d = next.log_odds, &new_shift = next.shift, &nonfinite = next.nonfinite;
  // in the accumulate type, as the backward reads them (common.h: stats_type)
  const at::Tensor stats = blocks_stats(
      nseg, iters, [&](at::IntArrayRef sizes) { return at::empty(sizes, log_odds.options()); });
  const blocks::BlocksForwardArgs a = in.forward_args(shift, mask_acc, new_d, new_shift, stats,
                                                      nonfinite, iters, neutral_nonfinite);
  run_blocks(a, nseg, m, scores.scalar_type());
  auto mask =
      mask_acc.scalar_type() == scores.scalar_type() ? mask_acc : mask_acc.to(scores.scalar_type());
  return {mask, new_d, new_shift, stats, nonfinite};
}

std::tuple<at::Tensor, at::Tensor> transport_mask_blocks_backward_cuda(
    const at::Tensor& grad_mask, const at::Tensor& scores_in, const at::Tensor& keep_in,
    const at::Tensor& eps_in, const at::Tensor& log_odds_in, const at::Tensor& stats_in,
    bool neutral_nonfinite, int64_t m) {
  const c10::cuda::CUDAGuard guard(scores_in.device());
  const int64_t nseg = keep_in.numel();
  const BlocksInputs in = blocks_inputs(scores_in, keep_in, eps_in, log_odds_in);
  const at::Tensor &scores = in.scores, &log_odds = in.log_odds;
  const at::Tensor stats = blocks_stats_layout(stats_in);
  const auto g = grad_mask.to(in.acc).contiguous();
  auto grad_x = at::empty({scores.numel()}, log_odds.options());
  auto grad_keep = at::empty({nseg}, log_odds.options());
  const blocks::BlocksBackwardArgs a =
      in.backward_args(g, stats, grad_x, grad_keep, neutral_nonfinite);
  run_blocks(a, nseg, m, scores.scalar_type());
  auto grad_keep_out =
      keep_in.scalar_type() == in.acc ? grad_keep : grad_keep.to(keep_in.scalar_type());
  return {grad_x.to(scores.scalar_type()), grad_keep_out};
}

}  // namespace dtp
