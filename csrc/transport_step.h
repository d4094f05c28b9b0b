// The eager per-step entry of transport_mask (csrc/transport_step.cpp), bound in ops.cpp.
#pragma once

#include <ATen/ATen.h>

namespace dtp {

// dtp::transport_mask with the next log-odds, shift and non-finite flags in the pending
// buffers (written there by the CPU kernel, else copied) and has_pending set. Returns the
// mask.
at::Tensor transport_mask_step(const at::Tensor& scores, const at::Tensor& offsets,
                               const at::Tensor& keep, const at::Tensor& eps,
                               const at::Tensor& log_odds, const at::Tensor& shift, int64_t iters,
                               bool neutral_nonfinite, int64_t blocks_per_segment,
                               int64_t segment_size, at::Tensor pending_log_odds,
                               at::Tensor pending_shift, at::Tensor pending_nonfinite,
                               at::Tensor has_pending);

// TransportState.commit: the pending log-odds and shift made current, the step counted
// (and the held segments' skipped steps), the pending flags cleared. Plain loops for
// contiguous CPU buffers, one kernel for contiguous CUDA ones, torch ops otherwise.
void transport_commit(at::Tensor log_odds, at::Tensor shift, const at::Tensor& pending_log_odds,
                      const at::Tensor& pending_shift, at::Tensor steps, at::Tensor skipped_steps,
                      at::Tensor has_pending, at::Tensor pending_nonfinite);

// The commit as one CUDA kernel (csrc/transport_commit_cuda.cu), for contiguous buffers on
// one GPU (log-odds and shift float32 or float64, steps int64, flags bool); only in CUDA
// builds.
void transport_commit_cuda(at::Tensor& log_odds, at::Tensor& shift,
                           const at::Tensor& pending_log_odds, const at::Tensor& pending_shift,
                           at::Tensor& steps, at::Tensor& skipped_steps, at::Tensor& has_pending,
                           at::Tensor& pending_nonfinite);

}  // namespace dtp
