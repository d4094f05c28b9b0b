// CUDA kernels of the DTP transport-mask step, any number of Sinkhorn iterations, with
// the per-element formulas of transport_math.h (the same the CPU kernels use).
//
// Two schedules, chosen on the host from numel and the segment count alone (reading the
// offsets would cost a device-to-host sync):
// - fused: one block per segment, all segments in one launch forward and one backward;
//   best while the step is launch-bound (every layer-group layout of a CNN).
// - split: B blocks per segment for large inputs. Each block writes its partial sums, and
//   one thread per segment merges them in block order between passes: a fixed reduction
//   order, so results are bitwise reproducible, and no atomics.
// Each block reduces with cub::BlockReduce (a fixed tree). The non-finite guard is
// decided on the device, with no host sync.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
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

template <class acc_t>
__device__ __forceinline__ bool is_finite(acc_t v) {
  return v - v == acc_t(0);  // NaN for inf and NaN
}

// x_i = d_i + (2 s_i - 1) / eps; `neutral`: a non-finite s_i enters as 0.5 (x_i = d_i).
template <class scalar_t, class acc_t>
__device__ __forceinline__ acc_t log_odds_at(const scalar_t* s, const acc_t* d, int64_t i,
                                             acc_t inv_eps, bool neutral) {
  const acc_t raw = static_cast<acc_t>(s[i]);
  const acc_t si = (neutral && !is_finite(raw)) ? acc_t(0.5) : raw;
  return d[i] + (acc_t(2) * si - acc_t(1)) * inv_eps;
}

// Whether element i counts against its segment's finiteness: s_i or x_i not finite.
template <class scalar_t, class acc_t>
__device__ __forceinline__ int bad_at(const scalar_t* s, int64_t i, acc_t x) {
  return (is_finite(static_cast<acc_t>(s[i])) && is_finite(x)) ? 0 : 1;
}

// A score read as the neutral 0.5 gets no gradient.
template <class scalar_t, class acc_t>
__device__ __forceinline__ acc_t zero_if_neutral(const scalar_t* s, int64_t i, bool neutral,
                                                 acc_t grad) {
  return (neutral && !is_finite(static_cast<acc_t>(s[i]))) ? acc_t(0) : grad;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    transport_mask_fwd_kernel(const scalar_t* __restrict__ scores,
                              const int64_t* __restrict__ offsets, const double* __restrict__ keep,
                              const double* __restrict__ eps, const acc_t* __restrict__ log_odds,
                              const acc_t* __restrict__ shift, int64_t iters, bool neutral,
                              scalar_t* __restrict__ mask, acc_t* __restrict__ new_log_odds,
                              acc_t* __restrict__ new_shift, double* __restrict__ stats,
                              bool* __restrict__ nonfinite) {
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
    const acc_t v = log_odds_at(scores, log_odds, i, inv_eps, neutral);
    local.lo = v < local.lo ? v : local.lo;
    local.hi = v > local.hi ? v : local.hi;
    local.bad += bad_at(scores, i, v);
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
      const acc_t z = log_odds_at(scores, log_odds, i, inv_eps, neutral) + dl;
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
    const bool bad = ext.bad != 0 || !::isfinite(sh_delta_new);
    nonfinite[seg] = bad;
    sh_advance = !degenerate && !bad;
    new_shift[seg] = sh_advance ? static_cast<acc_t>(sh_delta_new) : shift[seg];
  }
  __syncthreads();

  const acc_t dl = static_cast<acc_t>(sh_delta_last), l1 = static_cast<acc_t>(sh_l1);
  const acc_t dn = static_cast<acc_t>(sh_delta_new), kk = static_cast<acc_t>(k);
  const acc_t constant = static_cast<acc_t>(k / static_cast<double>(n));
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const acc_t x = log_odds_at(scores, log_odds, i, inv_eps, neutral);
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
                              const double* __restrict__ stats, int64_t iters, bool neutral,
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
    const acc_t z = log_odds_at(scores, log_odds, i, inv_eps, neutral) + dl;
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
      const acc_t z = log_odds_at(scores, log_odds, i, inv_eps, neutral) + pd;
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
    const acc_t x = log_odds_at(scores, log_odds, i, inv_eps, neutral);
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
    grad_scores[i] = static_cast<scalar_t>(zero_if_neutral(scores, i, neutral, scale * grad));
  }
  if (threadIdx.x == 0) {
    grad_keep[seg] = degenerate ? sums.d / static_cast<double>(n)
                                : sh_gp + grad_bias * n / (k * (static_cast<double>(n) - k));
  }
}

// ---- split schedule: B blocks per segment ------------------------------------------

constexpr int kSegThreads = 128;                  // one thread per segment in the merge kernels
constexpr int64_t kSplitFrom = int64_t(1) << 16;  // below this many elements: fused
constexpr int64_t kMinPerBlock = 4096;            // split no finer than this many elements a block

// Block b of segment s covers [begin + b * chunk, min(end, begin + (b + 1) * chunk)).
struct Range {
  int64_t seg, lo, hi;
};
__device__ __forceinline__ Range block_range(const int64_t* offsets, int64_t blocks_per_seg) {
  const int64_t seg = blockIdx.x / blocks_per_seg, part = blockIdx.x % blocks_per_seg;
  const int64_t begin = offsets[seg], end = offsets[seg + 1];
  const int64_t chunk = (end - begin + blocks_per_seg - 1) / blocks_per_seg;
  const int64_t lo = min(end, begin + part * chunk);
  return {seg, lo, min(end, lo + chunk)};
}

__device__ __forceinline__ int64_t segment_thread() {
  return blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
}

// Per-segment scalars of the split forward, carried between its launches.
struct FwdSeg {
  double lo, hi;          // extremes of x
  double delta, m1, m0;   // shift of this pass (rounded to acc_t) and its stabilisers
  double delta_last, l1;  // shift and log column mass of the last pass
  double delta_new;       // the updated shift
  int bad;                // non-finite x in the segment
};

__device__ inline void set_stabilisers(FwdSeg& st) {
  const double m1 = log_sigmoid(st.hi + st.delta), m0 = log_sigmoid(-(st.lo + st.delta));
  st.m1 = ::isfinite(m1) ? m1 : 0.0;
  st.m0 = ::isfinite(m0) ? m0 : 0.0;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_extremes_kernel(const scalar_t* __restrict__ scores, const int64_t* __restrict__ offsets,
                          const double* __restrict__ eps, const acc_t* __restrict__ log_odds,
                          bool neutral, int64_t blocks_per_seg, MinMaxBad* __restrict__ part) {
  using ReduceMMB = cub::BlockReduce<MinMaxBad, kThreads>;
  __shared__ typename ReduceMMB::TempStorage temp;
  const Range r = block_range(offsets, blocks_per_seg);
  const acc_t inv_eps = static_cast<acc_t>(1.0 / eps[r.seg]);
  MinMaxBad local{INFINITY, -INFINITY, 0};
  for (int64_t i = r.lo + threadIdx.x; i < r.hi; i += kThreads) {
    const acc_t v = log_odds_at(scores, log_odds, i, inv_eps, neutral);
    local.lo = v < local.lo ? v : local.lo;
    local.hi = v > local.hi ? v : local.hi;
    local.bad += bad_at(scores, i, v);
  }
  const MinMaxBad ext = ReduceMMB(temp).Reduce(local, MinMaxBadOp());
  if (threadIdx.x == 0) part[blockIdx.x] = ext;
}

template <class acc_t>
__global__ void split_start_kernel(const MinMaxBad* __restrict__ part,
                                   const acc_t* __restrict__ shift, int64_t nseg,
                                   int64_t blocks_per_seg, FwdSeg* __restrict__ seg) {
  const int64_t s = segment_thread();
  if (s >= nseg) return;
  MinMaxBad ext = part[s * blocks_per_seg];
  for (int64_t b = 1; b < blocks_per_seg; ++b)
    ext = MinMaxBadOp()(ext, part[s * blocks_per_seg + b]);
  FwdSeg st;
  st.lo = ext.lo;
  st.hi = ext.hi;
  st.bad = ext.bad;
  st.delta = static_cast<double>(static_cast<acc_t>(shift[s]));
  set_stabilisers(st);
  st.delta_last = st.delta;
  st.l1 = 0.0;
  st.delta_new = st.delta;
  seg[s] = st;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_sums_kernel(const scalar_t* __restrict__ scores, const int64_t* __restrict__ offsets,
                      const double* __restrict__ eps, const acc_t* __restrict__ log_odds,
                      bool neutral, int64_t blocks_per_seg, const FwdSeg* __restrict__ seg,
                      Pair<double>* __restrict__ part) {
  using ReducePair = cub::BlockReduce<Pair<double>, kThreads>;
  __shared__ typename ReducePair::TempStorage temp;
  const Range r = block_range(offsets, blocks_per_seg);
  const acc_t inv_eps = static_cast<acc_t>(1.0 / eps[r.seg]);
  const acc_t dl = static_cast<acc_t>(seg[r.seg].delta), m1 = static_cast<acc_t>(seg[r.seg].m1),
              m0 = static_cast<acc_t>(seg[r.seg].m0);
  acc_t s1 = 0, s0 = 0;
  for (int64_t i = r.lo + threadIdx.x; i < r.hi; i += kThreads) {
    const acc_t z = log_odds_at(scores, log_odds, i, inv_eps, neutral) + dl;
    const acc_t q = sigmoid_abs(z);
    s1 += exp_log_sigmoid(z, m1, q);
    s0 += exp_log_sigmoid(-z, m0, q);
  }
  const Pair<double> sums = ReducePair(temp).Sum(Pair<double>{double(s1), double(s0)});
  if (threadIdx.x == 0) part[blockIdx.x] = sums;
}

// One Sinkhorn pass's per-segment update: delta_t = B + delta_{t-1} - L1 + L0.
template <class acc_t>
__global__ void split_step_kernel(const Pair<double>* __restrict__ part,
                                  const int64_t* __restrict__ offsets,
                                  const double* __restrict__ keep, int64_t nseg,
                                  int64_t blocks_per_seg, int64_t t, int64_t iters,
                                  FwdSeg* __restrict__ seg, double* __restrict__ stats) {
  const int64_t s = segment_thread();
  if (s >= nseg) return;
  Pair<double> sums = part[s * blocks_per_seg];
  for (int64_t b = 1; b < blocks_per_seg; ++b) sums = sums + part[s * blocks_per_seg + b];
  FwdSeg st = seg[s];
  const int64_t n = offsets[s + 1] - offsets[s];
  const double k = keep[s];
  const double bias = is_degenerate(k, n) ? 0.0 : ::log(k) - ::log(static_cast<double>(n) - k);
  const double l1 = st.m1 + ::log(sums.a), l0 = st.m0 + ::log(sums.b);
  double* row = stats + (s * iters + t) * 3;
  row[0] = st.delta;
  row[1] = l1;
  row[2] = l0;
  st.delta_last = st.delta;
  st.l1 = l1;
  const double next = bias + st.delta - l1 + l0;
  st.delta = static_cast<double>(static_cast<acc_t>(next));
  st.delta_new = next;
  set_stabilisers(st);
  seg[s] = st;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_output_kernel(const scalar_t* __restrict__ scores, const int64_t* __restrict__ offsets,
                        const double* __restrict__ keep, const double* __restrict__ eps,
                        const acc_t* __restrict__ log_odds, const acc_t* __restrict__ shift,
                        bool neutral, int64_t blocks_per_seg, const FwdSeg* __restrict__ seg,
                        scalar_t* __restrict__ mask, acc_t* __restrict__ new_log_odds,
                        acc_t* __restrict__ new_shift, bool* __restrict__ nonfinite) {
  const Range r = block_range(offsets, blocks_per_seg);
  const FwdSeg st = seg[r.seg];
  const int64_t n = offsets[r.seg + 1] - offsets[r.seg];
  const double k = keep[r.seg];
  const bool degenerate = is_degenerate(k, n);
  const bool bad = st.bad != 0 || !::isfinite(st.delta_new);
  const bool advance = !degenerate && !bad;
  if (blockIdx.x % blocks_per_seg == 0 && threadIdx.x == 0) {
    new_shift[r.seg] = advance ? static_cast<acc_t>(st.delta_new) : shift[r.seg];
    nonfinite[r.seg] = bad;
  }
  const acc_t inv_eps = static_cast<acc_t>(1.0 / eps[r.seg]);
  const acc_t dl = static_cast<acc_t>(st.delta_last), l1 = static_cast<acc_t>(st.l1);
  const acc_t dn = static_cast<acc_t>(st.delta_new), kk = static_cast<acc_t>(k);
  const acc_t constant = static_cast<acc_t>(k / static_cast<double>(n));
  for (int64_t i = r.lo + threadIdx.x; i < r.hi; i += kThreads) {
    const acc_t x = log_odds_at(scores, log_odds, i, inv_eps, neutral);
    const acc_t z = x + dl;
    const acc_t m = degenerate ? constant : kk * exp_log_sigmoid(z, l1, sigmoid_abs(z));
    mask[i] = static_cast<scalar_t>(m);
    new_log_odds[i] = advance ? x + dn : log_odds[i];
  }
}

// Per-segment scalars of the split backward.
struct BwdSeg {
  double gp, gdelta, grad_bias, gs;
};

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_bwd_sums_kernel(const acc_t* __restrict__ grad_mask, const scalar_t* __restrict__ scores,
                          const int64_t* __restrict__ offsets, const double* __restrict__ eps,
                          const acc_t* __restrict__ log_odds, const double* __restrict__ stats,
                          int64_t iters, bool neutral, int64_t blocks_per_seg,
                          Quad<double>* __restrict__ part) {
  using ReduceQuad = cub::BlockReduce<Quad<double>, kThreads>;
  __shared__ typename ReduceQuad::TempStorage temp;
  const Range r = block_range(offsets, blocks_per_seg);
  const acc_t inv_eps = static_cast<acc_t>(1.0 / eps[r.seg]);
  const double* last = stats + (r.seg * iters + iters - 1) * 3;
  const acc_t dl = static_cast<acc_t>(last[0]), l1 = static_cast<acc_t>(last[1]);
  acc_t gp = 0, gq = 0, qs = 0, gs = 0;
  for (int64_t i = r.lo + threadIdx.x; i < r.hi; i += kThreads) {
    const acc_t z = log_odds_at(scores, log_odds, i, inv_eps, neutral) + dl;
    const acc_t q1 = sigmoid_abs(z);
    const acc_t p = exp_log_sigmoid(z, l1, q1), q = exp_log_sigmoid_pair(z, l1, q1);
    const acc_t g = grad_mask[i];
    gp += g * p;
    gq += g * q;
    qs += q;
    gs += g;
  }
  const Quad<double> sums =
      ReduceQuad(temp).Sum(Quad<double>{double(gp), double(gq), double(qs), double(gs)});
  if (threadIdx.x == 0) part[blockIdx.x] = sums;
}

__global__ void split_bwd_start_kernel(const Quad<double>* __restrict__ part,
                                       const double* __restrict__ keep, int64_t nseg,
                                       int64_t blocks_per_seg, BwdSeg* __restrict__ seg) {
  const int64_t s = segment_thread();
  if (s >= nseg) return;
  Quad<double> sums = part[s * blocks_per_seg];
  for (int64_t b = 1; b < blocks_per_seg; ++b) sums = sums + part[s * blocks_per_seg + b];
  seg[s] = BwdSeg{sums.a, keep[s] * (sums.b - sums.a * sums.c), 0.0, sums.d};
}

// Sums of w_i = q(z_i; L1) + q(z_i; L0) of pass t (1-based) for the chain through delta.
template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_bwd_pass_kernel(const scalar_t* __restrict__ scores, const int64_t* __restrict__ offsets,
                          const double* __restrict__ eps, const acc_t* __restrict__ log_odds,
                          const double* __restrict__ stats, int64_t iters, int64_t t, bool neutral,
                          int64_t blocks_per_seg, double* __restrict__ part) {
  using ReduceOne = cub::BlockReduce<double, kThreads>;
  __shared__ typename ReduceOne::TempStorage temp;
  const Range r = block_range(offsets, blocks_per_seg);
  const acc_t inv_eps = static_cast<acc_t>(1.0 / eps[r.seg]);
  const double* row = stats + (r.seg * iters + t - 1) * 3;
  const acc_t pd = static_cast<acc_t>(row[0]), a1 = static_cast<acc_t>(row[1]),
              a0 = static_cast<acc_t>(row[2]);
  acc_t w = 0;
  for (int64_t i = r.lo + threadIdx.x; i < r.hi; i += kThreads) {
    const acc_t z = log_odds_at(scores, log_odds, i, inv_eps, neutral) + pd;
    const acc_t q1 = sigmoid_abs(z);
    w += exp_log_sigmoid_pair(z, a1, q1) + exp_log_sigmoid_pair(z, a0, q1);
  }
  const double total = ReduceOne(temp).Sum(double(w));
  if (threadIdx.x == 0) part[blockIdx.x] = total;
}

__global__ void split_bwd_step_kernel(const double* __restrict__ part, int64_t nseg,
                                      int64_t blocks_per_seg, int64_t t, int64_t npass,
                                      BwdSeg* __restrict__ seg, double* __restrict__ coef) {
  const int64_t s = segment_thread();
  if (s >= nseg) return;
  double total = part[s * blocks_per_seg];
  for (int64_t b = 1; b < blocks_per_seg; ++b) total += part[s * blocks_per_seg + b];
  BwdSeg st = seg[s];
  coef[s * npass + t - 1] = -st.gdelta;
  st.grad_bias += st.gdelta;
  st.gdelta *= 1.0 - total;
  seg[s] = st;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_bwd_output_kernel(const acc_t* __restrict__ grad_mask,
                            const scalar_t* __restrict__ scores,
                            const int64_t* __restrict__ offsets, const double* __restrict__ keep,
                            const double* __restrict__ eps, const acc_t* __restrict__ log_odds,
                            const double* __restrict__ stats, int64_t iters, bool neutral,
                            int64_t blocks_per_seg, const BwdSeg* __restrict__ seg,
                            const double* __restrict__ coef, scalar_t* __restrict__ grad_scores,
                            double* __restrict__ grad_keep) {
  const Range r = block_range(offsets, blocks_per_seg);
  const BwdSeg st = seg[r.seg];
  const int64_t n = offsets[r.seg + 1] - offsets[r.seg];
  const double k = keep[r.seg];
  const bool degenerate = is_degenerate(k, n);
  if (blockIdx.x % blocks_per_seg == 0 && threadIdx.x == 0) {
    grad_keep[r.seg] = degenerate ? st.gs / static_cast<double>(n)
                                  : st.gp + st.grad_bias * n / (k * (static_cast<double>(n) - k));
  }
  const acc_t inv_eps = static_cast<acc_t>(1.0 / eps[r.seg]);
  const double* last = stats + (r.seg * iters + iters - 1) * 3;
  const acc_t dl = static_cast<acc_t>(last[0]), l1 = static_cast<acc_t>(last[1]);
  const acc_t kk = static_cast<acc_t>(k), gpa = static_cast<acc_t>(st.gp);
  const acc_t scale = degenerate ? acc_t(0) : static_cast<acc_t>(2.0 * inv_eps);
  const int64_t npass = iters - 1;
  for (int64_t i = r.lo + threadIdx.x; i < r.hi; i += kThreads) {
    const acc_t x = log_odds_at(scores, log_odds, i, inv_eps, neutral);
    const acc_t z = x + dl;
    const acc_t q1 = sigmoid_abs(z);
    acc_t grad = kk * exp_log_sigmoid_pair(z, l1, q1) * (grad_mask[i] - gpa);
    for (int64_t t = 0; t < npass; ++t) {
      const double* row = stats + (r.seg * iters + t) * 3;
      const acc_t zt = x + static_cast<acc_t>(row[0]);
      const acc_t rt = sigmoid_abs(zt);
      const acc_t w = exp_log_sigmoid_pair(zt, static_cast<acc_t>(row[1]), rt) +
                      exp_log_sigmoid_pair(zt, static_cast<acc_t>(row[2]), rt);
      grad += static_cast<acc_t>(coef[r.seg * npass + t]) * w;
    }
    grad_scores[i] = static_cast<scalar_t>(zero_if_neutral(scores, i, neutral, scale * grad));
  }
}

// Blocks per segment: 1 (fused) for small inputs, else enough blocks to fill the GPU twice
// with at least kMinPerBlock elements each. Decided from numel and nseg, known on the
// host. DTP_CUDA_BLOCKS_PER_SEGMENT overrides it (tests and benchmarks use it).
int64_t blocks_per_segment(int64_t numel, int64_t nseg) {
  if (const char* env = std::getenv("DTP_CUDA_BLOCKS_PER_SEGMENT"); env != nullptr && *env) {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    TORCH_CHECK(end != env && *end == '\0' && v >= 1,
                "DTP_CUDA_BLOCKS_PER_SEGMENT must be an integer >= 1, got '", env, "'");
    return v;
  }
  if (numel < kSplitFrom) return 1;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t fill = (2 * sms + nseg - 1) / nseg;
  const int64_t work = (numel + nseg * kMinPerBlock - 1) / (nseg * kMinPerBlock);
  return std::max<int64_t>(1, std::min(fill, work));
}

// Bytes for `count` objects of T, rounded up so the next array stays 16-byte aligned.
template <class T>
int64_t aligned_bytes(int64_t count) {
  return (count * int64_t(sizeof(T)) + 15) / 16 * 16;
}

int segment_blocks(int64_t nseg) {
  return static_cast<int>((nseg + kSegThreads - 1) / kSegThreads);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_cuda(
    const at::Tensor& scores_in, const at::Tensor& offsets_in, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds_in, const at::Tensor& shift_in, int64_t iters,
    bool neutral) {
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
  auto nonfinite = at::empty({nseg}, log_odds.options().dtype(at::kBool));
  const int64_t bps = blocks_per_segment(scores.numel(), nseg);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, scores.scalar_type(), "transport_mask_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        const auto* sc = scores.data_ptr<scalar_t>();
        const auto* off = offsets.data_ptr<int64_t>();
        const auto* kp = keep_d.data_ptr<double>();
        const auto* ep = eps_d.data_ptr<double>();
        const auto* lo = log_odds.data_ptr<acc_t>();
        const auto* sh = shift.data_ptr<acc_t>();
        if (bps == 1) {
          transport_mask_fwd_kernel<scalar_t, acc_t><<<nseg, kThreads, 0, stream>>>(
              sc, off, kp, ep, lo, sh, iters, neutral, mask.data_ptr<scalar_t>(),
              new_d.data_ptr<acc_t>(), new_shift.data_ptr<acc_t>(), stats.data_ptr<double>(),
              nonfinite.data_ptr<bool>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          return;
        }
        const int64_t seg_bytes = aligned_bytes<FwdSeg>(nseg);
        const int64_t ext_bytes = aligned_bytes<MinMaxBad>(nseg * bps);
        auto work = at::empty({seg_bytes + ext_bytes + aligned_bytes<Pair<double>>(nseg * bps)},
                              scores.options().dtype(at::kByte));
        auto* seg = reinterpret_cast<FwdSeg*>(work.data_ptr<uint8_t>());
        auto* ext = reinterpret_cast<MinMaxBad*>(work.data_ptr<uint8_t>() + seg_bytes);
        auto* sums =
            reinterpret_cast<Pair<double>*>(work.data_ptr<uint8_t>() + seg_bytes + ext_bytes);
        const int64_t grid = nseg * bps;
        split_extremes_kernel<scalar_t, acc_t>
            <<<grid, kThreads, 0, stream>>>(sc, off, ep, lo, neutral, bps, ext);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        split_start_kernel<acc_t>
            <<<segment_blocks(nseg), kSegThreads, 0, stream>>>(ext, sh, nseg, bps, seg);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        for (int64_t t = 0; t < iters; ++t) {
          split_sums_kernel<scalar_t, acc_t>
              <<<grid, kThreads, 0, stream>>>(sc, off, ep, lo, neutral, bps, seg, sums);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          split_step_kernel<acc_t><<<segment_blocks(nseg), kSegThreads, 0, stream>>>(
              sums, off, kp, nseg, bps, t, iters, seg, stats.data_ptr<double>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        split_output_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(
            sc, off, kp, ep, lo, sh, neutral, bps, seg, mask.data_ptr<scalar_t>(),
            new_d.data_ptr<acc_t>(), new_shift.data_ptr<acc_t>(), nonfinite.data_ptr<bool>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {mask, new_d, new_shift, stats, nonfinite};
}

std::tuple<at::Tensor, at::Tensor> transport_mask_backward_cuda(
    const at::Tensor& grad_mask, const at::Tensor& scores_in, const at::Tensor& offsets_in,
    const at::Tensor& keep, const at::Tensor& eps, const at::Tensor& log_odds_in,
    const at::Tensor& stats_in, bool neutral) {
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
  const int64_t bps = blocks_per_segment(scores.numel(), nseg);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, scores.scalar_type(), "transport_mask_backward_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        const auto* gm = g.data_ptr<acc_t>();
        const auto* sc = scores.data_ptr<scalar_t>();
        const auto* off = offsets.data_ptr<int64_t>();
        const auto* kp = keep_d.data_ptr<double>();
        const auto* ep = eps_d.data_ptr<double>();
        const auto* lo = log_odds.data_ptr<acc_t>();
        const auto* st = stats.data_ptr<double>();
        if (bps == 1) {
          transport_mask_bwd_kernel<scalar_t, acc_t><<<nseg, kThreads, 0, stream>>>(
              gm, sc, off, kp, ep, lo, st, iters, neutral, coef.data_ptr<double>(),
              grad_scores.data_ptr<scalar_t>(), grad_keep.data_ptr<double>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          return;
        }
        const int64_t seg_bytes = aligned_bytes<BwdSeg>(nseg);
        const int64_t quad_bytes = aligned_bytes<Quad<double>>(nseg * bps);
        auto work = at::empty({seg_bytes + quad_bytes + aligned_bytes<double>(nseg * bps)},
                              scores.options().dtype(at::kByte));
        auto* seg = reinterpret_cast<BwdSeg*>(work.data_ptr<uint8_t>());
        auto* quads = reinterpret_cast<Quad<double>*>(work.data_ptr<uint8_t>() + seg_bytes);
        auto* wsum = reinterpret_cast<double*>(work.data_ptr<uint8_t>() + seg_bytes + quad_bytes);
        const int64_t grid = nseg * bps, npass = iters - 1;
        split_bwd_sums_kernel<scalar_t, acc_t>
            <<<grid, kThreads, 0, stream>>>(gm, sc, off, ep, lo, st, iters, neutral, bps, quads);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        split_bwd_start_kernel<<<segment_blocks(nseg), kSegThreads, 0, stream>>>(quads, kp, nseg,
                                                                                 bps, seg);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        for (int64_t t = npass; t >= 1; --t) {
          split_bwd_pass_kernel<scalar_t, acc_t>
              <<<grid, kThreads, 0, stream>>>(sc, off, ep, lo, st, iters, t, neutral, bps, wsum);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          split_bwd_step_kernel<<<segment_blocks(nseg), kSegThreads, 0, stream>>>(
              wsum, nseg, bps, t, npass, seg, coef.data_ptr<double>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        split_bwd_output_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(
            gm, sc, off, kp, ep, lo, st, iters, neutral, bps, seg, coef.data_ptr<double>(),
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
