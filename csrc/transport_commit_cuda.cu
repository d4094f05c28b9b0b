// TransportState.commit on a GPU as one kernel: the pending log-odds and shift copied to
// the current ones, the step counted, each held segment's skipped steps counted, the
// pending flags cleared. The four torch ops it replaces cost four launches of host time
// per training step (csrc/transport_step.cpp calls this for contiguous CUDA buffers).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "transport_step.h"

namespace dtp {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: a copy needs no more to fill a GPU

template <class T>
struct CommitArgs {
  T* log_odds;
  T* shift;
  const T* pending_log_odds;
  const T* pending_shift;
  int64_t* steps;
  int64_t* skipped_steps;
  bool* has_pending;
  bool* pending_nonfinite;
  int64_t numel, nseg;
};

// Every index is read and written by one thread only (the flags by the thread that reads
// them), so no ordering between threads is needed.
template <class T>
__global__ void __launch_bounds__(kThreads) commit_kernel(const CommitArgs<T> a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t i = first; i < a.numel; i += stride) a.log_odds[i] = a.pending_log_odds[i];
  for (int64_t s = first; s < a.nseg; s += stride) {
    a.shift[s] = a.pending_shift[s];
    if (a.pending_nonfinite[s]) {  // rare (NaN/Inf scores): no count read or written else
      a.skipped_steps[s] += 1;
      a.pending_nonfinite[s] = false;
    }
  }
  if (first == 0) {
    *a.steps += *a.has_pending ? 1 : 0;
    *a.has_pending = false;
  }
}

template <class T>
void launch_commit(const CommitArgs<T>& a) {
  const int64_t work = std::max<int64_t>({a.numel, a.nseg, 1});
  const int64_t blocks = std::min(kMaxBlocks, (work + kThreads - 1) / kThreads);
  commit_kernel<T><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void transport_commit_cuda(at::Tensor& log_odds, at::Tensor& shift,
                           const at::Tensor& pending_log_odds, const at::Tensor& pending_shift,
                           at::Tensor& steps, at::Tensor& skipped_steps, at::Tensor& has_pending,
                           at::Tensor& pending_nonfinite) {
  const c10::cuda::CUDAGuard guard(log_odds.device());
  const int64_t numel = log_odds.numel(), nseg = shift.numel();
  if (log_odds.scalar_type() == at::kDouble) {
    launch_commit<double>({log_odds.data_ptr<double>(), shift.data_ptr<double>(),
                           pending_log_odds.const_data_ptr<double>(),
                           pending_shift.const_data_ptr<double>(), steps.data_ptr<int64_t>(),
                           skipped_steps.data_ptr<int64_t>(), has_pending.data_ptr<bool>(),
                           pending_nonfinite.data_ptr<bool>(), numel, nseg});
  } else {
    launch_commit<float>({log_odds.data_ptr<float>(), shift.data_ptr<float>(),
                          pending_log_odds.const_data_ptr<float>(),
                          pending_shift.const_data_ptr<float>(), steps.data_ptr<int64_t>(),
                          skipped_steps.data_ptr<int64_t>(), has_pending.data_ptr<bool>(),
                          pending_nonfinite.data_ptr<bool>(), numel, nseg});
  }
}

}  // namespace dtp
