// The transport-mask step for segments of one small size M (4, 8 or 16): entry points of
// transport_mask_blocks_cpu.cpp and transport_mask_blocks_cuda.cu, which dtp::transport_mask's
// CPU and CUDA kernels call when their segment_size argument is M (and on CUDA no
// blocks_per_segment forces the general schedule). The arguments are checked by them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>

#include "common.h"
#include "transport_blocks_tile.h"

namespace dtp {

// f(std::integral_constant<int, M>{}) for the segment size m (4, 8 or 16, checked by the
// caller): the one place where the runtime size becomes the kernels' template constant.
template <class F>
void with_segment_size(int64_t m, const F& f) {
  if (m == 4) {
    f(std::integral_constant<int, 4>{});
  } else if (m == 8) {
    f(std::integral_constant<int, 8>{});
  } else {
    f(std::integral_constant<int, 16>{});
  }
}

// The inputs both directions read on either device: contiguous, keep in the accumulate
// type (the kernels' k), eps as float64, each one value per segment or one for all.
struct BlocksInputs {
  at::ScalarType acc;
  at::Tensor scores;
  PerSegment keep, eps;
  at::Tensor log_odds;

  // The kernels' arguments: these inputs and the outputs given (in the accumulate type,
  // stats too; flags bool).
  blocks::BlocksForwardArgs forward_args(const at::Tensor& shift, const at::Tensor& mask,
                                         const at::Tensor& new_d, const at::Tensor& new_shift,
                                         const at::Tensor& stats, const at::Tensor& nonfinite,
                                         int64_t iters, bool neutral) const {
    return {scores.data_ptr(),
            keep.values.data_ptr(),
            eps.values.data_ptr<double>(),
            keep.stride,
            eps.stride,
            log_odds.data_ptr(),
            shift.data_ptr(),
            mask.data_ptr(),
            new_d.data_ptr(),
            new_shift.data_ptr(),
            stats.data_ptr(),
            nonfinite.data_ptr<bool>(),
            stats.size(0),
            iters,
            neutral,
            rows_aligned({&scores, &log_odds, &mask, &new_d})};
  }
  blocks::BlocksBackwardArgs backward_args(const at::Tensor& grad_mask, const at::Tensor& stats,
                                           const at::Tensor& grad_scores,
                                           const at::Tensor& grad_keep, bool neutral) const {
    return {grad_mask.data_ptr(),
            scores.data_ptr(),
            keep.values.data_ptr(),
            eps.values.data_ptr<double>(),
            keep.stride,
            eps.stride,
            log_odds.data_ptr(),
            stats.data_ptr(),
            grad_scores.data_ptr(),
            grad_keep.data_ptr(),
            stats.size(0),
            stats.size(1),
            neutral,
            rows_aligned({&grad_mask, &scores, &log_odds, &grad_scores})};
  }

  // Every tensor's data 16-byte aligned: the one-segment tiles then move whole rows
  // (transport_blocks_rows.h).
  static bool rows_aligned(std::initializer_list<const at::Tensor*> tensors) {
    for (const at::Tensor* t : tensors) {
      if (reinterpret_cast<std::uintptr_t>(t->data_ptr()) % 16 != 0) return false;
    }
    return true;
  }
};

// The tile kernels' stats: the op's (nseg, iters, 3) laid out (iters, 3, nseg) in memory
// (blocks::stats_at), from `empty` (a tensor of the sizes it is given).
template <class Empty>
at::Tensor blocks_stats(int64_t nseg, int64_t iters, const Empty& empty) {
  return empty({iters, int64_t(3), nseg}).permute({2, 0, 1});
}

// stats in that layout: as the forward returned them (checked from the strides, no view
// made per step), else copied into it.
inline at::Tensor blocks_stats_layout(const at::Tensor& stats) {
  const int64_t nseg = stats.size(0), iters = stats.size(1);
  const bool laid_out =
      stats.numel() == 0 || ((nseg == 1 || stats.stride(0) == 1) && stats.stride(2) == nseg &&
                             (iters == 1 || stats.stride(1) == 3 * nseg));
  return laid_out ? stats : stats.permute({1, 2, 0}).contiguous().permute({2, 0, 1});
}

inline BlocksInputs blocks_inputs(const at::Tensor& scores, const at::Tensor& keep,
                                  const at::Tensor& eps, const at::Tensor& log_odds) {
  const auto acc = acc_type(scores);
  return {acc, scores.contiguous(), per_segment(keep, acc), per_segment(eps, at::kDouble),
          log_odds.contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_blocks_cpu(
    const at::Tensor& scores, const at::Tensor& keep, const at::Tensor& eps,
    const at::Tensor& log_odds, const at::Tensor& shift, int64_t iters, bool neutral_nonfinite,
    int64_t segment_size);

std::tuple<at::Tensor, at::Tensor> transport_mask_blocks_backward_cpu(
    const at::Tensor& grad_mask, const at::Tensor& scores, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds, const at::Tensor& stats,
    bool neutral_nonfinite, int64_t segment_size);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_blocks_cuda(
    const at::Tensor& scores, const at::Tensor& keep, const at::Tensor& eps,
    const at::Tensor& log_odds, const at::Tensor& shift, int64_t iters, bool neutral_nonfinite,
    int64_t segment_size);

std::tuple<at::Tensor, at::Tensor> transport_mask_blocks_backward_cuda(
    const at::Tensor& grad_mask, const at::Tensor& scores, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds, const at::Tensor& stats,
    bool neutral_nonfinite, int64_t segment_size);

}  // namespace dtp
