// CUDA kernels of the DTP transport-mask step: one block per segment, all segments in one
// launch forward and one backward, any number of Sinkhorn iterations. Each block reduces
// its segment with cub::BlockReduce (a fixed reduction tree: bitwise reproducible, no
// atomics) and uses the per-element formulas of transport_math.h, the same the CPU
// kernels use. The non-finite guard is decided in the block, with no host sync.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include "block_sums.cuh"
#include "transport_math.h"

namespace dtp {
namespace {

constexpr int kThreads = 256;

struct MinMaxBad {
  double lo, hi;
  int bad;
};
struct MinMaxBadOp {
  __device__ MinMaxBad operator()(const MinMaxBad& x, const MinMaxBad& y) const {
    return {x.lo < y.lo ? x.lo : y.lo, x.hi > y.hi ? x.hi : y.hi, x.bad + y.bad};
  }
};

template <class scalar_t, class acc_t>
__device__ __forceinline__ acc_t log_odds_at(const scalar_t* s, const acc_t* d, int64_t i,
                                             acc_t inv_eps) {
  return d[i] + (acc_t(2) * static_cast<acc_t>(s[i]) - acc_t(1)) * inv_eps;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    transport_mask_fwd_kernel(const scalar_t* __restrict__ scores,
                              const int64_t* __restrict__ offsets, const double* __restrict__ keep,
                              const double* __restrict__ eps, const acc_t* __restrict__ log_odds,
                              const acc_t* __restrict__ shift, int64_t iters,
                              scalar_t* __restrict__ mask, acc_t* __restrict__ new_log_odds,
                              acc_t* __restrict__ new_shift, double* __restrict__ stats) {
  using ReduceMMB = cub::BlockReduce<MinMaxBad, kThreads>;
  using ReducePair = cub::BlockReduce<Pair<double>, kThreads>;
  __shared__ union {
    typename ReduceMMB::TempStorage mmb;
    typename ReducePair::TempStorage pair;
  } temp;
  __shared__ double sh_delta, sh_m1, sh_m0, sh_l1, sh_delta_last, sh_delta_new;
  __shared__ bool sh_advance;

  const int64_t seg = blockIdx.x;
  const int64_t begin = offsets[seg], end = offsets[seg + 1], n = end - begin;
  const double k = keep[seg];
  const acc_t inv_eps = static_cast<acc_t>(1.0 / eps[seg]);
  const bool degenerate = is_degenerate(k, n);

  // Extremes of x (log sigmoid is monotone: they give each column's max) and finiteness.
  MinMaxBad local{INFINITY, -INFINITY, 0};
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const acc_t v = log_odds_at(scores, log_odds, i, inv_eps);
    local.lo = v < local.lo ? v : local.lo;
    local.hi = v > local.hi ? v : local.hi;
    local.bad += (v - v == acc_t(0)) ? 0 : 1;
  }
  const MinMaxBad ext = ReduceMMB(temp.mmb).Reduce(local, MinMaxBadOp());
  if (threadIdx.x == 0) sh_delta = static_cast<double>(static_cast<acc_t>(shift[seg]));
  __syncthreads();
  const double bias = degenerate ? 0.0 : ::log(k) - ::log(static_cast<double>(n) - k);

  for (int64_t t = 0; t < iters; ++t) {
    if (threadIdx.x == 0) {
      const double m1 = log_sigmoid(ext.hi + sh_delta), m0 = log_sigmoid(-(ext.lo + sh_delta));
      sh_m1 = ::isfinite(m1) ? m1 : 0.0;
      sh_m0 = ::isfinite(m0) ? m0 : 0.0;
    }
    __syncthreads();
    const acc_t dl = static_cast<acc_t>(sh_delta), m1 = static_cast<acc_t>(sh_m1),
                m0 = static_cast<acc_t>(sh_m0);
    acc_t s1 = 0, s0 = 0;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const acc_t z = log_odds_at(scores, log_odds, i, inv_eps) + dl;
      const acc_t r = sigmoid_abs(z);
      s1 += exp_log_sigmoid(z, m1, r);
      s0 += exp_log_sigmoid(-z, m0, r);
    }
    const Pair<double> sums = ReducePair(temp.pair).Sum(Pair<double>{double(s1), double(s0)});
    if (threadIdx.x == 0) {
      const double l1 = sh_m1 + ::log(sums.a), l0 = sh_m0 + ::log(sums.b);
      double* row = stats + (seg * iters + t) * 3;
      row[0] = sh_delta;
      row[1] = l1;
      row[2] = l0;
      sh_delta_last = sh_delta;
      sh_l1 = l1;
      const double next = bias + sh_delta - l1 + l0;
      sh_delta = static_cast<double>(static_cast<acc_t>(next));
      sh_delta_new = next;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sh_advance = !degenerate && ext.bad == 0 && ::isfinite(sh_delta_new);
    new_shift[seg] = sh_advance ? static_cast<acc_t>(sh_delta_new) : shift[seg];
  }
  __syncthreads();

  const acc_t dl = static_cast<acc_t>(sh_delta_last), l1 = static_cast<acc_t>(sh_l1);
  const acc_t dn = static_cast<acc_t>(sh_delta_new), kk = static_cast<acc_t>(k);
  const acc_t constant = static_cast<acc_t>(k / static_cast<double>(n));
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const acc_t x = log_odds_at(scores, log_odds, i, inv_eps);
    const acc_t z = x + dl;
    const acc_t m = degenerate ? constant : kk * exp_log_sigmoid(z, l1, sigmoid_abs(z));
    mask[i] = static_cast<scalar_t>(m);
    new_log_odds[i] = sh_advance ? x + dn : log_odds[i];
  }
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    transport_mask_bwd_kernel(const acc_t* __restrict__ grad_mask,
                              const scalar_t* __restrict__ scores,
                              const int64_t* __restrict__ offsets, const double* __restrict__ keep,
                              const double* __restrict__ eps, const acc_t* __restrict__ log_odds,
                              const double* __restrict__ stats, int64_t iters,
                              double* __restrict__ coef, scalar_t* __restrict__ grad_scores,
                              double* __restrict__ grad_keep) {
  using ReduceQuad = cub::BlockReduce<Quad<double>, kThreads>;
  using ReduceOne = cub::BlockReduce<double, kThreads>;
  __shared__ union {
    typename ReduceQuad::TempStorage quad;
    typename ReduceOne::TempStorage one;
  } temp;
  __shared__ double sh_gp, sh_gdelta;

  const int64_t seg = blockIdx.x;
  const int64_t begin = offsets[seg], end = offsets[seg + 1], n = end - begin;
  const double k = keep[seg];
  const acc_t inv_eps = static_cast<acc_t>(1.0 / eps[seg]);
  const bool degenerate = is_degenerate(k, n);
  const double* last = stats + (seg * iters + iters - 1) * 3;
  const acc_t dl = static_cast<acc_t>(last[0]), l1 = static_cast<acc_t>(last[1]);

  // Last pass: mask = k p; sums of g p, g q, q and g.
  acc_t gp = 0, gq = 0, qs = 0, gs = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const acc_t z = log_odds_at(scores, log_odds, i, inv_eps) + dl;
    const acc_t r = sigmoid_abs(z);
    const acc_t p = exp_log_sigmoid(z, l1, r), q = exp_log_sigmoid_pair(z, l1, r);
    const acc_t g = grad_mask[i];
    gp += g * p;
    gq += g * q;
    qs += q;
    gs += g;
  }
  const Quad<double> sums =
      ReduceQuad(temp.quad).Sum(Quad<double>{double(gp), double(gq), double(qs), double(gs)});
  if (threadIdx.x == 0) {
    sh_gp = sums.a;
    sh_gdelta = k * (sums.b - sums.a * sums.c);  // sum_i dL/dz_i of the last pass
  }
  __syncthreads();

  // Earlier passes: delta_t = B + delta_{t-1} - L1 + L0, d delta_t / d x_i = -w_i.
  const int64_t npass = iters - 1;
  double grad_bias = 0.0;
  for (int64_t t = npass; t >= 1; --t) {
    const double* row = stats + (seg * iters + t - 1) * 3;
    const acc_t pd = static_cast<acc_t>(row[0]), a1 = static_cast<acc_t>(row[1]),
                a0 = static_cast<acc_t>(row[2]);
    acc_t w = 0;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const acc_t z = log_odds_at(scores, log_odds, i, inv_eps) + pd;
      const acc_t r = sigmoid_abs(z);
      w += exp_log_sigmoid_pair(z, a1, r) + exp_log_sigmoid_pair(z, a0, r);
    }
    const double total = ReduceOne(temp.one).Sum(double(w));
    if (threadIdx.x == 0) {
      coef[seg * npass + t - 1] = -sh_gdelta;
      grad_bias += sh_gdelta;
      sh_gdelta *= 1.0 - total;
    }
    __syncthreads();
  }

  const acc_t kk = static_cast<acc_t>(k), gpa = static_cast<acc_t>(sh_gp);
  const acc_t scale = degenerate ? acc_t(0) : static_cast<acc_t>(2.0 * inv_eps);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const acc_t x = log_odds_at(scores, log_odds, i, inv_eps);
    const acc_t z = x + dl;
    const acc_t r = sigmoid_abs(z);
    acc_t grad = kk * exp_log_sigmoid_pair(z, l1, r) * (grad_mask[i] - gpa);
    for (int64_t t = 0; t < npass; ++t) {
      const double* row = stats + (seg * iters + t) * 3;
      const acc_t zt = x + static_cast<acc_t>(row[0]);
      const acc_t rt = sigmoid_abs(zt);
      const acc_t w = exp_log_sigmoid_pair(zt, static_cast<acc_t>(row[1]), rt) +
                      exp_log_sigmoid_pair(zt, static_cast<acc_t>(row[2]), rt);
      grad += static_cast<acc_t>(coef[seg * npass + t]) * w;
    }
    grad_scores[i] = static_cast<scalar_t>(scale * grad);
  }
  if (threadIdx.x == 0) {
    grad_keep[seg] = degenerate ? sums.d / static_cast<double>(n)
                                : sh_gp + grad_bias * n / (k * (static_cast<double>(n) - k));
  }
}

at::ScalarType acc_type(const at::Tensor& scores) {
  return scores.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check(const at::Tensor& scores, const at::Tensor& offsets, const at::Tensor& keep,
           const at::Tensor& eps, const at::Tensor& log_odds) {
  TORCH_CHECK(scores.dim() == 1 && scores.is_floating_point(),
              "dtp::transport_mask: scores must be a 1-D floating tensor");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.numel() >= 2,
              "dtp::transport_mask: offsets must be a 1-D int64 tensor with at least 2 entries");
  const int64_t nseg = offsets.numel() - 1;
  TORCH_CHECK(keep.numel() == nseg && eps.numel() == nseg,
              "dtp::transport_mask: keep and eps need one entry per segment (", nseg, ")");
  TORCH_CHECK(log_odds.scalar_type() == acc_type(scores) && log_odds.numel() == scores.numel(),
              "dtp::transport_mask: log_odds must be ", acc_type(scores), " with ", scores.numel(),
              " elements");
  for (const auto* t : {&offsets, &keep, &eps, &log_odds}) {
    TORCH_CHECK(t->device() == scores.device(),
                "dtp::transport_mask: all tensors must be on the scores' device");
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_cuda(
    const at::Tensor& scores_in, const at::Tensor& offsets_in, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds_in, const at::Tensor& shift_in,
    int64_t iters) {
  TORCH_CHECK(iters >= 1, "dtp::transport_mask: iters must be >= 1, got ", iters);
  check(scores_in, offsets_in, keep, eps, log_odds_in);
  const c10::cuda::CUDAGuard guard(scores_in.device());
  const auto scores = scores_in.contiguous();
  const auto offsets = offsets_in.contiguous();
  const auto log_odds = log_odds_in.contiguous();
  const auto shift = shift_in.contiguous();
  const auto keep_d = keep.to(at::kDouble).contiguous();
  const auto eps_d = eps.to(at::kDouble).contiguous();
  const int64_t nseg = offsets.numel() - 1;
  auto mask = at::empty_like(scores);
  auto new_d = at::empty_like(log_odds);
  auto new_shift = at::empty_like(shift);
  auto stats = at::empty({nseg, iters, 3}, log_odds.options().dtype(at::kDouble));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, scores.scalar_type(), "transport_mask_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        transport_mask_fwd_kernel<scalar_t, acc_t><<<nseg, kThreads, 0, stream>>>(
            scores.data_ptr<scalar_t>(), offsets.data_ptr<int64_t>(), keep_d.data_ptr<double>(),
            eps_d.data_ptr<double>(), log_odds.data_ptr<acc_t>(), shift.data_ptr<acc_t>(), iters,
            mask.data_ptr<scalar_t>(), new_d.data_ptr<acc_t>(), new_shift.data_ptr<acc_t>(),
            stats.data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {mask, new_d, new_shift, stats};
}

std::tuple<at::Tensor, at::Tensor> transport_mask_backward_cuda(
    const at::Tensor& grad_mask, const at::Tensor& scores_in, const at::Tensor& offsets_in,
    const at::Tensor& keep, const at::Tensor& eps, const at::Tensor& log_odds_in,
    const at::Tensor& stats_in) {
  check(scores_in, offsets_in, keep, eps, log_odds_in);
  TORCH_CHECK(stats_in.dim() == 3 && stats_in.size(0) == offsets_in.numel() - 1 &&
                  stats_in.size(2) == 3 && stats_in.scalar_type() == at::kDouble,
              "dtp::transport_mask_backward: stats must be float64 of shape (segments, iters, 3)");
  const c10::cuda::CUDAGuard guard(scores_in.device());
  const auto scores = scores_in.contiguous();
  const auto offsets = offsets_in.contiguous();
  const auto log_odds = log_odds_in.contiguous();
  const auto stats = stats_in.contiguous();
  const auto g = grad_mask.to(log_odds.scalar_type()).contiguous();
  const auto keep_d = keep.to(at::kDouble).contiguous();
  const auto eps_d = eps.to(at::kDouble).contiguous();
  const int64_t nseg = offsets.numel() - 1, iters = stats.size(1);
  auto grad_scores = at::empty_like(scores);
  auto grad_keep = at::empty({nseg}, log_odds.options().dtype(at::kDouble));
  auto coef =
      at::empty({nseg * std::max<int64_t>(iters - 1, 1)}, log_odds.options().dtype(at::kDouble));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, scores.scalar_type(), "transport_mask_backward_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        transport_mask_bwd_kernel<scalar_t, acc_t><<<nseg, kThreads, 0, stream>>>(
            g.data_ptr<acc_t>(), scores.data_ptr<scalar_t>(), offsets.data_ptr<int64_t>(),
            keep_d.data_ptr<double>(), eps_d.data_ptr<double>(), log_odds.data_ptr<acc_t>(),
            stats.data_ptr<double>(), iters, coef.data_ptr<double>(),
            grad_scores.data_ptr<scalar_t>(), grad_keep.data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {grad_scores, grad_keep.to(keep.scalar_type())};
}

TORCH_LIBRARY_IMPL(dtp, CUDA, m) {
  m.impl("transport_mask", &transport_mask_cuda);
  m.impl("transport_mask_backward", &transport_mask_backward_cuda);
}

}  // namespace dtp
