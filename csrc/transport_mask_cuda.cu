// CUDA kernels of the DTP transport-mask step, any number of Sinkhorn iterations, with
// the per-element formulas of transport_math.h (the same the CPU kernels use).
//
// Two schedules, chosen on the host from numel and the segment count alone (reading the
// offsets would cost a device-to-host sync), or forced by the op's blocks_per_segment:
// - fused: one block per segment, all segments in one launch forward and one backward;
//   best while the step is launch-bound (every layer-group layout of a CNN).
// - split: B blocks per segment for large inputs. Each block writes its partial sums, and
//   one warp per segment merges them between passes in an order fixed by B (merge_parts),
//   so results are bitwise reproducible, and no atomics.
// Both run the same phases: each element loop is one device function over a [lo, hi)
// range, and each per-segment update one device function of the merged sums. One
// iteration (the paper's step) first takes the column sums unstabilised in the same pass
// as the extremes, as the CPU kernels do: where every term is finite and neither sum is
// below n e^-60 they stand (two passes over the data instead of three), else the
// segment's sums are taken again, stabilised by the extremes. The fused
// kernels call them in sequence; the split schedule launches one kernel per phase.
// Each block reduces with cub::BlockReduce (a fixed tree). The non-finite guard is
// decided on the device, with no host sync.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <limits>
#include <type_traits>

#include "block_sums.cuh"
#include "common.h"
#include "lent_state_outputs.h"
#include "transport_blocks.h"
#include "transport_math.h"

namespace dtp {
namespace {

constexpr int kThreads = 256;
constexpr int kMergeWarps = 4;                    // the merge kernels: a warp per segment ...
constexpr int kSegThreads = 32 * kMergeWarps;     // ... and 4 segments per block
constexpr int64_t kSplitFrom = int64_t(1) << 16;  // below this many elements: fused
constexpr int64_t kMinPerBlock = 4096;            // split no finer than this many elements a block

// ---- per-segment state carried between phases ---------------------------------------

struct MinMaxBad {
  double lo, hi;
  int bad;
};
struct MinMaxBadOp {
  __device__ MinMaxBad operator()(const MinMaxBad& x, const MinMaxBad& y) const {
    return {x.lo < y.lo ? x.lo : y.lo, x.hi > y.hi ? x.hi : y.hi, x.bad + y.bad};
  }
};

// The first pass of one iteration: extremes and the unstabilised column sums together.
struct FirstPart {
  MinMaxBad ext;
  Pair<double> sums;
};
struct FirstPartOp {
  __device__ FirstPart operator()(const FirstPart& x, const FirstPart& y) const {
    return {MinMaxBadOp()(x.ext, y.ext), x.sums + y.sums};
  }
};

// Forward: the scalars of one segment between passes.
struct FwdSeg {
  double lo, hi;          // extremes of x
  double delta, m1, m0;   // shift of this pass (rounded to acc_t) and its stabilisers
  double delta_last, l1;  // shift and log column mass of the last pass
  double delta_new;       // the updated shift
  int bad;                // non-finite s or x in the segment
  bool stabilise;         // its sums are (still) to be taken stabilised
};

// Backward: sum g p, the gradient flowing into the shift, its sum over passes, sum g.
struct BwdSeg {
  double gp, gdelta, grad_bias, gs;
};

// ---- arguments: one struct per direction --------------------------------------------

template <class scalar_t, class acc_t>
struct Inputs {
  const scalar_t* scores;
  const int64_t* offsets;  // nseg + 1 entries
  const void* keep;        // float64 or (keep_double false) float32: read as given
  const double* eps;
  int64_t keep_stride;  // 1: one keep per segment; 0: one for all (common.h: per_segment)
  int64_t eps_stride;
  const acc_t* log_odds;  // current state d
  int64_t nseg, iters, blocks_per_seg;
  bool neutral;  // non-finite scores enter as 0.5 with zero gradient
  bool keep_double;
};

template <class scalar_t, class acc_t>
struct FwdParams : Inputs<scalar_t, acc_t> {
  const acc_t* shift;
  scalar_t* mask;
  acc_t* new_log_odds;
  acc_t* new_shift;
  double* stats;  // (nseg, iters, 3): shift used, L1, L0 per pass
  bool* nonfinite;
  // split schedule's workspace
  FwdSeg* seg;
  MinMaxBad* ext_part;
  FirstPart* first_part;  // one iteration: instead of ext_part
  Pair<double>* sum_part;
};

template <class scalar_t, class acc_t>
struct BwdParams : Inputs<scalar_t, acc_t> {
  const acc_t* grad_mask;
  const double* stats;
  double* coef;  // (nseg, iters - 1): the chain's coefficient of each earlier pass
  scalar_t* grad_scores;
  void* grad_keep;  // keep's dtype
  // split schedule's workspace
  BwdSeg* seg;
  Quad<double>* quad_part;
  double* w_part;
};

// ---- segments and ranges ----------------------------------------------------------

struct Segment {
  int64_t index, begin, end, n;
  double k;
  bool degenerate;
};

template <class scalar_t, class acc_t>
__device__ __forceinline__ double keep_at(const Inputs<scalar_t, acc_t>& p, int64_t s) {
  const int64_t i = s * p.keep_stride;
  return p.keep_double ? static_cast<const double*>(p.keep)[i]
                       : static_cast<double>(static_cast<const float*>(p.keep)[i]);
}

template <class P>
__device__ __forceinline__ Segment segment_at(const P& p, int64_t s) {
  const int64_t begin = p.offsets[s], end = p.offsets[s + 1];
  const double k = keep_at(p, s);
  return {s, begin, end, end - begin, k, is_degenerate(k, end - begin)};
}

// The elements [lo, hi) of a segment this block covers: all of it when blocks_per_seg
// is 1, else part blockIdx.x % blocks_per_seg of equal chunks.
struct Range {
  Segment seg;
  int64_t lo, hi;
  bool first;  // the segment's first block: it writes the per-segment outputs
};

template <class P>
__device__ __forceinline__ Range block_range(const P& p) {
  const int64_t s = blockIdx.x / p.blocks_per_seg, part = blockIdx.x % p.blocks_per_seg;
  const Segment g = segment_at(p, s);
  const int64_t chunk = (g.n + p.blocks_per_seg - 1) / p.blocks_per_seg;
  const int64_t lo = min(g.end, g.begin + part * chunk);
  return {g, lo, min(g.end, lo + chunk), part == 0};
}

// The segment of this thread's warp in the merge kernels (every lane of a warp has the
// same, so a warp returns as a whole), and the thread's lane.
__device__ __forceinline__ int64_t merge_segment() {
  return (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
}
__device__ __forceinline__ bool lane_zero() { return threadIdx.x % 32 == 0; }

template <class acc_t>
__device__ __forceinline__ bool is_finite(acc_t v) {
  return v - v == acc_t(0);  // NaN for inf and NaN
}

template <class scalar_t, class acc_t>
__device__ __forceinline__ acc_t inv_eps_of(const Inputs<scalar_t, acc_t>& p, int64_t s) {
  return static_cast<acc_t>(1.0 / p.eps[s * p.eps_stride]);
}

// x_i = d_i + (2 s_i - 1) / eps; `neutral`: a non-finite s_i enters as 0.5 (x_i = d_i).
template <class scalar_t, class acc_t>
__device__ __forceinline__ acc_t log_odds_at(const Inputs<scalar_t, acc_t>& p, int64_t i,
                                             acc_t inv_eps) {
  const acc_t raw = static_cast<acc_t>(p.scores[i]);
  const acc_t si = (p.neutral && !is_finite(raw)) ? acc_t(0.5) : raw;
  return p.log_odds[i] + (acc_t(2) * si - acc_t(1)) * inv_eps;
}

__device__ __forceinline__ double bias_of(const Segment& g) {
  return g.degenerate ? 0.0 : ::log(g.k) - ::log(static_cast<double>(g.n) - g.k);
}

// ---- forward phases ---------------------------------------------------------------

// Extremes of x (log sigmoid is monotone: they give each column's max) and finiteness,
// this thread's share of [lo, hi).
template <class scalar_t, class acc_t>
__device__ __forceinline__ MinMaxBad extremes_phase(const Inputs<scalar_t, acc_t>& p, acc_t inv_eps,
                                                    int64_t lo, int64_t hi) {
  MinMaxBad local{INFINITY, -INFINITY, 0};
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const acc_t v = log_odds_at(p, i, inv_eps);
    local.lo = v < local.lo ? v : local.lo;
    local.hi = v > local.hi ? v : local.hi;
    local.bad += (is_finite(static_cast<acc_t>(p.scores[i])) && is_finite(v)) ? 0 : 1;
  }
  return local;
}

__device__ __forceinline__ void set_stabilisers(FwdSeg& st) {
  const double m1 = log_sigmoid(st.hi + st.delta), m0 = log_sigmoid(-(st.lo + st.delta));
  st.m1 = ::isfinite(m1) ? m1 : 0.0;
  st.m0 = ::isfinite(m0) ? m0 : 0.0;
}

template <class acc_t>
__device__ __forceinline__ FwdSeg start_segment(const MinMaxBad& ext, acc_t shift) {
  FwdSeg st;
  st.lo = ext.lo;
  st.hi = ext.hi;
  st.bad = ext.bad;
  st.delta = static_cast<double>(static_cast<acc_t>(shift));
  set_stabilisers(st);
  st.delta_last = st.delta;
  st.l1 = 0.0;
  st.delta_new = st.delta;
  st.stabilise = true;
  return st;
}

// One iteration's first pass on [lo, hi): the extremes of x and finiteness, and the
// column sums sum_i sigmoid(z_i), sum_i sigmoid(-z_i) without a stabiliser (one exp per
// element; every term is in (0, 1], so nothing overflows).
template <class scalar_t, class acc_t>
__device__ __forceinline__ FirstPart first_phase(const Inputs<scalar_t, acc_t>& p, acc_t shift,
                                                 acc_t inv_eps, int64_t lo, int64_t hi) {
  MinMaxBad local{INFINITY, -INFINITY, 0};
  acc_t s1 = 0, s0 = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const acc_t v = log_odds_at(p, i, inv_eps);
    local.lo = v < local.lo ? v : local.lo;
    local.hi = v > local.hi ? v : local.hi;
    local.bad += (is_finite(static_cast<acc_t>(p.scores[i])) && is_finite(v)) ? 0 : 1;
    const acc_t z = v + shift;
    const auto parts = sigmoid_parts(z);
    s1 += scaled_sigmoid(z, parts, acc_t(1));
    s0 += scaled_sigmoid_neg(z, parts, acc_t(1));
  }
  return {local, {double(s1), double(s0)}};
}

// Column sums of one pass: sum_i exp(log sigmoid(z_i) - m1), sum_i exp(log sigmoid(-z_i) - m0).
template <class scalar_t, class acc_t>
__device__ __forceinline__ Pair<double> column_sums_phase(const Inputs<scalar_t, acc_t>& p,
                                                          const FwdSeg& st, acc_t inv_eps,
                                                          int64_t lo, int64_t hi) {
  const acc_t dl = static_cast<acc_t>(st.delta), m1 = static_cast<acc_t>(st.m1),
              m0 = static_cast<acc_t>(st.m0);
  acc_t s1 = 0, s0 = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const acc_t z = log_odds_at(p, i, inv_eps) + dl;
    const acc_t r = sigmoid_abs(z);
    s1 += exp_log_sigmoid(z, m1, r);
    s0 += exp_log_sigmoid(-z, m0, r);
  }
  return {double(s1), double(s0)};
}

// One pass's update from the segment's column sums: delta_t = B + delta_{t-1} - L1 + L0.
template <class acc_t>
__device__ __forceinline__ void sinkhorn_update(FwdSeg& st, const Pair<double>& sums,
                                                const Segment& g, int64_t t, int64_t iters,
                                                double* stats) {
  const double l1 = st.m1 + ::log(sums.a), l0 = st.m0 + ::log(sums.b);
  double* row = stats + (g.index * iters + t) * 3;
  row[0] = st.delta;
  row[1] = l1;
  row[2] = l0;
  st.delta_last = st.delta;
  st.l1 = l1;
  const double next = bias_of(g) + st.delta - l1 + l0;
  st.delta = static_cast<double>(static_cast<acc_t>(next));
  st.delta_new = next;
  set_stabilisers(st);
}

// A segment after one iteration's first pass. Its unstabilised sums stand when every s
// and x is finite and neither column sums below n e^-60 (the CPU kernels' test): then
// its stats row and next shift are set from them (stabilisers 0). Else it starts as
// without them, to take its sums stabilised by the extremes.
template <class acc_t>
__device__ __forceinline__ FwdSeg first_segment(const FirstPart& f, acc_t shift, const Segment& g,
                                                double* stats) {
  FwdSeg st = start_segment(f.ext, shift);
  const double least = static_cast<double>(g.n) * ::exp(kMinScaledShift);
  st.stabilise = !(f.ext.bad == 0 && f.sums.a >= least && f.sums.b >= least);  // NaN: false
  if (!st.stabilise) {
    st.m1 = st.m0 = 0.0;
    sinkhorn_update<acc_t>(st, f.sums, g, 0, 1, stats);
  }
  return st;
}

// Mask and next log-odds on [lo, hi); `flags` also writes the segment's next shift and
// non-finite flag. A degenerate or non-finite segment keeps its state.
template <class scalar_t, class acc_t>
__device__ __forceinline__ void output_phase(const FwdParams<scalar_t, acc_t>& p, const FwdSeg& st,
                                             const Segment& g, acc_t inv_eps, int64_t lo,
                                             int64_t hi, bool flags) {
  const bool bad = st.bad != 0 || !::isfinite(st.delta_new);
  const bool advance = !g.degenerate && !bad;
  if (flags) {
    p.new_shift[g.index] = advance ? static_cast<acc_t>(st.delta_new) : p.shift[g.index];
    p.nonfinite[g.index] = bad;
  }
  const acc_t dl = static_cast<acc_t>(st.delta_last), l1 = static_cast<acc_t>(st.l1);
  const acc_t dn = static_cast<acc_t>(st.delta_new), kk = static_cast<acc_t>(g.k);
  const acc_t constant = static_cast<acc_t>(g.k / static_cast<double>(g.n));
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const acc_t x = log_odds_at(p, i, inv_eps);
    const acc_t z = x + dl;
    const acc_t m = g.degenerate ? constant : kk * exp_log_sigmoid(z, l1, sigmoid_abs(z));
    p.mask[i] = static_cast<scalar_t>(m);
    p.new_log_odds[i] = advance ? x + dn : p.log_odds[i];
  }
}

// ---- backward phases --------------------------------------------------------------

// Last pass: mask = k p; sums of g p, g q, q and g.
template <class scalar_t, class acc_t>
__device__ __forceinline__ Quad<double> grad_sums_phase(const BwdParams<scalar_t, acc_t>& p,
                                                        const Segment& g, acc_t inv_eps, int64_t lo,
                                                        int64_t hi) {
  const double* last = p.stats + (g.index * p.iters + p.iters - 1) * 3;
  const acc_t dl = static_cast<acc_t>(last[0]), l1 = static_cast<acc_t>(last[1]);
  acc_t gp = 0, gq = 0, qs = 0, gs = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const acc_t z = log_odds_at(p, i, inv_eps) + dl;
    const acc_t r = sigmoid_abs(z);
    const acc_t pi = exp_log_sigmoid(z, l1, r), qi = exp_log_sigmoid_pair(z, l1, r);
    const acc_t gi = p.grad_mask[i];
    gp += gi * pi;
    gq += gi * qi;
    qs += qi;
    gs += gi;
  }
  return {double(gp), double(gq), double(qs), double(gs)};
}

__device__ __forceinline__ BwdSeg start_backward(const Quad<double>& sums, double k) {
  return {sums.a, k * (sums.b - sums.a * sums.c), 0.0, sums.d};  // gdelta: sum_i dL/dz_i
}

// w_i = -d(L1 - L0)/dz_i of pass t: sigmoid(z) sigmoid(-z) (1/S1 + 1/S0).
template <class acc_t>
__device__ __forceinline__ acc_t pass_weight(acc_t x, const double* row) {
  const acc_t z = x + static_cast<acc_t>(row[0]);
  const acc_t r = sigmoid_abs(z);
  return exp_log_sigmoid_pair(z, static_cast<acc_t>(row[1]), r) +
         exp_log_sigmoid_pair(z, static_cast<acc_t>(row[2]), r);
}

// Sum of w_i over [lo, hi) for pass t (1-based) of the chain through delta.
template <class scalar_t, class acc_t>
__device__ __forceinline__ double pass_weight_phase(const BwdParams<scalar_t, acc_t>& p,
                                                    const Segment& g, acc_t inv_eps, int64_t t,
                                                    int64_t lo, int64_t hi) {
  const double* row = p.stats + (g.index * p.iters + t - 1) * 3;
  acc_t w = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    w += pass_weight(log_odds_at(p, i, inv_eps), row);
  }
  return double(w);
}

// delta_t = B + delta_{t-1} - L1 + L0 depends on x (d delta_t / d x_i = -w_i) and on
// delta_{t-1} (d delta_t / d delta_{t-1} = 1 - W, W = sum_i w_i).
__device__ __forceinline__ void chain_update(BwdSeg& st, double total, double* coef) {
  *coef = -st.gdelta;
  st.grad_bias += st.gdelta;
  st.gdelta *= 1.0 - total;
}

// grad_i = (k q_i (g_i - gp) + sum_t coef_t w_i(pass t)) * 2 / eps on [lo, hi); `flags`
// also writes the segment's keep gradient.
template <class scalar_t, class acc_t>
__device__ __forceinline__ void grad_output_phase(const BwdParams<scalar_t, acc_t>& p,
                                                  const BwdSeg& st, const Segment& g, acc_t inv_eps,
                                                  int64_t lo, int64_t hi, bool flags) {
  if (flags) {
    const double grad_keep =
        g.degenerate ? st.gs / static_cast<double>(g.n)
                     : st.gp + st.grad_bias * g.n / (g.k * (static_cast<double>(g.n) - g.k));
    if (p.keep_double) {
      static_cast<double*>(p.grad_keep)[g.index] = grad_keep;
    } else {
      static_cast<float*>(p.grad_keep)[g.index] = static_cast<float>(grad_keep);
    }
  }
  const double* last = p.stats + (g.index * p.iters + p.iters - 1) * 3;
  const acc_t dl = static_cast<acc_t>(last[0]), l1 = static_cast<acc_t>(last[1]);
  const acc_t kk = static_cast<acc_t>(g.k), gpa = static_cast<acc_t>(st.gp);
  const acc_t scale = g.degenerate ? acc_t(0) : static_cast<acc_t>(2.0 * inv_eps);
  const int64_t npass = p.iters - 1;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const acc_t x = log_odds_at(p, i, inv_eps);
    const acc_t z = x + dl;
    acc_t grad = kk * exp_log_sigmoid_pair(z, l1, sigmoid_abs(z)) * (p.grad_mask[i] - gpa);
    for (int64_t t = 0; t < npass; ++t) {
      grad += static_cast<acc_t>(p.coef[g.index * npass + t]) *
              pass_weight(x, p.stats + (g.index * p.iters + t) * 3);
    }
    // A score read as the neutral 0.5 gets no gradient, nor does a degenerate segment
    // (its mask is constant), even where grad is NaN.
    const bool neutral_here = p.neutral && !is_finite(static_cast<acc_t>(p.scores[i]));
    const bool none = neutral_here || g.degenerate;
    p.grad_scores[i] = static_cast<scalar_t>(none ? acc_t(0) : scale * grad);
  }
}

// ---- fused schedule: one block per segment, phases in sequence --------------------

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads) fused_fwd_kernel(const FwdParams<scalar_t, acc_t> p) {
  using ReduceMMB = cub::BlockReduce<MinMaxBad, kThreads>;
  using ReduceFirst = cub::BlockReduce<FirstPart, kThreads>;
  using ReducePair = cub::BlockReduce<Pair<double>, kThreads>;
  __shared__ union {
    typename ReduceMMB::TempStorage mmb;
    typename ReduceFirst::TempStorage first;
    typename ReducePair::TempStorage pair;
  } temp;
  __shared__ FwdSeg st;
  const Segment g = segment_at(p, blockIdx.x);
  const acc_t inv_eps = inv_eps_of(p, g.index);

  if (p.iters == 1) {
    const acc_t shift = p.shift[g.index];
    const FirstPart f = ReduceFirst(temp.first)
                            .Reduce(first_phase(p, shift, inv_eps, g.begin, g.end), FirstPartOp());
    if (threadIdx.x == 0) st = first_segment(f, shift, g, p.stats);
  } else {
    const MinMaxBad ext =
        ReduceMMB(temp.mmb).Reduce(extremes_phase(p, inv_eps, g.begin, g.end), MinMaxBadOp());
    if (threadIdx.x == 0) st = start_segment(ext, p.shift[g.index]);
  }
  __syncthreads();
  const bool stabilise = st.stabilise;  // the block's: every thread takes the same path
  for (int64_t t = 0; stabilise && t < p.iters; ++t) {
    const Pair<double> sums =
        ReducePair(temp.pair).Sum(column_sums_phase(p, st, inv_eps, g.begin, g.end));
    if (threadIdx.x == 0) sinkhorn_update<acc_t>(st, sums, g, t, p.iters, p.stats);
    __syncthreads();
  }
  output_phase(p, st, g, inv_eps, g.begin, g.end, threadIdx.x == 0);
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads) fused_bwd_kernel(const BwdParams<scalar_t, acc_t> p) {
  using ReduceQuad = cub::BlockReduce<Quad<double>, kThreads>;
  using ReduceOne = cub::BlockReduce<double, kThreads>;
  __shared__ union {
    typename ReduceQuad::TempStorage quad;
    typename ReduceOne::TempStorage one;
  } temp;
  __shared__ BwdSeg st;
  const Segment g = segment_at(p, blockIdx.x);
  const acc_t inv_eps = inv_eps_of(p, g.index);

  const Quad<double> sums =
      ReduceQuad(temp.quad).Sum(grad_sums_phase(p, g, inv_eps, g.begin, g.end));
  if (threadIdx.x == 0) st = start_backward(sums, g.k);
  __syncthreads();
  const int64_t npass = p.iters - 1;
  for (int64_t t = npass; t >= 1; --t) {
    const double total =
        ReduceOne(temp.one).Sum(pass_weight_phase(p, g, inv_eps, t, g.begin, g.end));
    if (threadIdx.x == 0) chain_update(st, total, p.coef + g.index * npass + t - 1);
    __syncthreads();  // also publishes coef to the block
  }
  grad_output_phase(p, st, g, inv_eps, g.begin, g.end, threadIdx.x == 0);
}

// ---- split schedule: blocks_per_seg blocks per segment, one launch per phase -------

// Segment s's block partials merged by its warp: lane l folds partials l, l + 32, ... in
// order, then cub::WarpReduce joins the lanes in a fixed tree. The order depends only on
// the count (bitwise reproducible), and the 32 lanes load at once: a segment split over
// a whole GPU's blocks has a thousand partials. The result is lane 0's.
template <class T, class Op>
__device__ __forceinline__ T merge_parts(const T* parts, int64_t s, int64_t blocks, Op op) {
  using WarpReduce = cub::WarpReduce<T>;
  __shared__ typename WarpReduce::TempStorage temp[kMergeWarps];
  const int lane = threadIdx.x % 32;
  const T* part = parts + s * blocks;
  T local = part[lane < blocks ? lane : 0];  // lanes past the count: not reduced
  for (int64_t b = lane + 32; b < blocks; b += 32) local = op(local, part[b]);
  const int valid = static_cast<int>(blocks < 32 ? blocks : 32);
  return WarpReduce(temp[threadIdx.x / 32]).Reduce(local, op, valid);
}
struct AddOp {
  template <class T>
  __device__ T operator()(const T& x, const T& y) const {
    return x + y;
  }
};

// This block's partial of its segment part: the block's values reduced (cub::BlockReduce,
// a fixed tree; sums through its Sum) and stored by thread 0 at parts[blockIdx.x].
template <class T, class Op>
__device__ __forceinline__ void store_block_part(const T& value, Op op, T* parts) {
  using Reduce = cub::BlockReduce<T, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  T total;
  if constexpr (std::is_same_v<Op, AddOp>) {
    total = Reduce(temp).Sum(value);
  } else {
    total = Reduce(temp).Reduce(value, op);
  }
  if (threadIdx.x == 0) parts[blockIdx.x] = total;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_extremes_kernel(const FwdParams<scalar_t, acc_t> p) {
  const Range r = block_range(p);
  const acc_t inv_eps = inv_eps_of(p, r.seg.index);
  store_block_part(extremes_phase(p, inv_eps, r.lo, r.hi), MinMaxBadOp(), p.ext_part);
}

template <class scalar_t, class acc_t>
__global__ void split_start_kernel(const FwdParams<scalar_t, acc_t> p) {
  const int64_t s = merge_segment();
  if (s >= p.nseg) return;
  const MinMaxBad ext = merge_parts(p.ext_part, s, p.blocks_per_seg, MinMaxBadOp());
  if (lane_zero()) p.seg[s] = start_segment(ext, p.shift[s]);
}

// One iteration: the extremes and unstabilised sums of each block's part ...
template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads) split_first_kernel(const FwdParams<scalar_t, acc_t> p) {
  const Range r = block_range(p);
  const acc_t inv_eps = inv_eps_of(p, r.seg.index);
  store_block_part(first_phase(p, p.shift[r.seg.index], inv_eps, r.lo, r.hi), FirstPartOp(),
                   p.first_part);
}

// ... merged per segment: sums that stand finish its iteration.
template <class scalar_t, class acc_t>
__global__ void split_first_start_kernel(const FwdParams<scalar_t, acc_t> p) {
  const int64_t s = merge_segment();
  if (s >= p.nseg) return;
  const FirstPart f = merge_parts(p.first_part, s, p.blocks_per_seg, FirstPartOp());
  if (lane_zero()) p.seg[s] = first_segment(f, p.shift[s], segment_at(p, s), p.stats);
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads) split_sums_kernel(const FwdParams<scalar_t, acc_t> p) {
  const Range r = block_range(p);
  if (!p.seg[r.seg.index].stabilise) return;  // the whole block: no partials to write
  const acc_t inv_eps = inv_eps_of(p, r.seg.index);
  store_block_part(column_sums_phase(p, p.seg[r.seg.index], inv_eps, r.lo, r.hi), AddOp(),
                   p.sum_part);
}

template <class scalar_t, class acc_t>
__global__ void split_step_kernel(const FwdParams<scalar_t, acc_t> p, int64_t t) {
  const int64_t s = merge_segment();
  if (s >= p.nseg) return;
  if (!p.seg[s].stabilise) return;  // its one iteration's sums stood (first_segment)
  const Pair<double> sums = merge_parts(p.sum_part, s, p.blocks_per_seg, AddOp());
  if (!lane_zero()) return;
  FwdSeg st = p.seg[s];
  sinkhorn_update<acc_t>(st, sums, segment_at(p, s), t, p.iters, p.stats);
  p.seg[s] = st;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_output_kernel(const FwdParams<scalar_t, acc_t> p) {
  const Range r = block_range(p);
  output_phase(p, p.seg[r.seg.index], r.seg, inv_eps_of(p, r.seg.index), r.lo, r.hi,
               r.first && threadIdx.x == 0);
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_bwd_sums_kernel(const BwdParams<scalar_t, acc_t> p) {
  const Range r = block_range(p);
  store_block_part(grad_sums_phase(p, r.seg, inv_eps_of(p, r.seg.index), r.lo, r.hi), AddOp(),
                   p.quad_part);
}

template <class scalar_t, class acc_t>
__global__ void split_bwd_start_kernel(const BwdParams<scalar_t, acc_t> p) {
  const int64_t s = merge_segment();
  if (s >= p.nseg) return;
  const Quad<double> sums = merge_parts(p.quad_part, s, p.blocks_per_seg, AddOp());
  if (lane_zero()) p.seg[s] = start_backward(sums, keep_at(p, s));
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_bwd_pass_kernel(const BwdParams<scalar_t, acc_t> p, int64_t t) {
  const Range r = block_range(p);
  store_block_part(pass_weight_phase(p, r.seg, inv_eps_of(p, r.seg.index), t, r.lo, r.hi), AddOp(),
                   p.w_part);
}

template <class scalar_t, class acc_t>
__global__ void split_bwd_step_kernel(const BwdParams<scalar_t, acc_t> p, int64_t t) {
  const int64_t s = merge_segment();
  if (s >= p.nseg) return;
  const double total = merge_parts(p.w_part, s, p.blocks_per_seg, AddOp());
  if (!lane_zero()) return;
  BwdSeg st = p.seg[s];
  const int64_t npass = p.iters - 1;
  chain_update(st, total, p.coef + s * npass + t - 1);
  p.seg[s] = st;
}

template <class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    split_bwd_output_kernel(const BwdParams<scalar_t, acc_t> p) {
  const Range r = block_range(p);
  grad_output_phase(p, p.seg[r.seg.index], r.seg, inv_eps_of(p, r.seg.index), r.lo, r.hi,
                    r.first && threadIdx.x == 0);
}

// ---- host side ----------------------------------------------------------------------

// Blocks of kThreads the current GPU holds at once for the split schedule's element
// kernels of this dtype: the fewest any of them fits on one SM, times the SMs. Asked of
// the runtime once per device.
template <class scalar_t, class acc_t>
int64_t resident_split_blocks() {
  constexpr int kDevices = 64;
  static std::array<std::atomic<int>, kDevices> cached{};  // 0: not asked yet
  const int device = c10::cuda::current_device();
  int per_sm = device < kDevices ? cached[device].load(std::memory_order_relaxed) : 0;
  if (per_sm == 0) {
    per_sm = std::numeric_limits<int>::max();
    for (const void* kernel :
         {reinterpret_cast<const void*>(split_first_kernel<scalar_t, acc_t>),
          reinterpret_cast<const void*>(split_extremes_kernel<scalar_t, acc_t>),
          reinterpret_cast<const void*>(split_sums_kernel<scalar_t, acc_t>),
          reinterpret_cast<const void*>(split_output_kernel<scalar_t, acc_t>),
          reinterpret_cast<const void*>(split_bwd_sums_kernel<scalar_t, acc_t>),
          reinterpret_cast<const void*>(split_bwd_pass_kernel<scalar_t, acc_t>),
          reinterpret_cast<const void*>(split_bwd_output_kernel<scalar_t, acc_t>)}) {
      int blocks = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
      per_sm = std::min(per_sm, std::max(blocks, 1));
    }
    if (device < kDevices) cached[device].store(per_sm, std::memory_order_relaxed);
  }
  return int64_t(per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// Blocks per segment: `requested` when > 0; else 1 (fused) for small inputs, and above
// kSplitFrom elements as many blocks as the GPU holds at once (spread over the segments),
// each with at least kMinPerBlock elements. A streaming pass needs every SM full to keep
// enough loads in flight (two blocks an SM gave under a fifth of copy bandwidth on an
// H200). Decided from numel, nseg and the device, known on the host.
template <class scalar_t, class acc_t>
int64_t blocks_per_segment(int64_t numel, int64_t nseg, int64_t requested) {
  if (requested > 0) return requested;
  if (numel < kSplitFrom) return 1;
  const int64_t fill = (resident_split_blocks<scalar_t, acc_t>() + nseg - 1) / nseg;
  const int64_t work = (numel + nseg * kMinPerBlock - 1) / (nseg * kMinPerBlock);
  return std::max<int64_t>(1, std::min(fill, work));
}

int segment_blocks(int64_t nseg) {  // a warp per segment
  return static_cast<int>((nseg + kMergeWarps - 1) / kMergeWarps);
}

// One byte buffer holding the split schedule's arrays, each 16-byte aligned.
class Workspace {
 public:
  template <class T>
  void reserve(int64_t count) {
    bytes_ += (count * int64_t(sizeof(T)) + 15) / 16 * 16;
  }
  void allocate(const at::Tensor& like) {
    buffer_ = at::empty({bytes_}, like.options().dtype(at::kByte));
    bytes_ = 0;
  }
  template <class T>
  T* take(int64_t count) {  // in the order of reserve()
    T* out = reinterpret_cast<T*>(buffer_.data_ptr<uint8_t>() + bytes_);
    reserve<T>(count);
    return out;
  }

 private:
  at::Tensor buffer_;
  int64_t bytes_ = 0;
};

// The inputs both directions read, as contiguous device tensors kept alive by the caller.
struct InputTensors {
  at::Tensor scores, offsets;
  PerSegment keep, eps;
  at::Tensor log_odds;
  int64_t nseg, requested_blocks;
};

// keep stays float32 or float64 as given (the kernels read either; a conversion would be
// one more launch and allocation per step in each direction), other dtypes become float64.
PerSegment kernel_keep(const at::Tensor& keep) {
  const auto dtype = keep.scalar_type();
  return per_segment(keep, dtype == at::kFloat || dtype == at::kDouble ? dtype : at::kDouble);
}

// t in `dtype`, contiguous; no dispatch when it already is (the usual case every step).
at::Tensor contiguous_as(const at::Tensor& t, at::ScalarType dtype) {
  return (t.scalar_type() == dtype ? t : t.to(dtype)).contiguous();
}

// The general kernels' inputs, after check_inputs.
InputTensors input_tensors(const at::Tensor& scores, const at::Tensor& offsets,
                           const at::Tensor& keep, const at::Tensor& eps,
                           const at::Tensor& log_odds, int64_t requested_blocks) {
  const int64_t nseg = offsets.numel() - 1;
  return {scores.contiguous(),   offsets.contiguous(),
          kernel_keep(keep),     per_segment(eps, at::kDouble),
          log_odds.contiguous(), nseg,
          requested_blocks};
}

template <class scalar_t, class acc_t>
void fill_inputs(Inputs<scalar_t, acc_t>& p, const InputTensors& in, int64_t iters, bool neutral) {
  p.scores = in.scores.data_ptr<scalar_t>();
  p.offsets = in.offsets.data_ptr<int64_t>();
  p.keep = in.keep.values.const_data_ptr();
  p.keep_double = in.keep.values.scalar_type() == at::kDouble;
  p.eps = in.eps.values.data_ptr<double>();
  p.keep_stride = in.keep.stride;
  p.eps_stride = in.eps.stride;
  p.log_odds = in.log_odds.data_ptr<acc_t>();
  p.nseg = in.nseg;
  p.iters = iters;
  p.blocks_per_seg =
      blocks_per_segment<scalar_t, acc_t>(in.scores.numel(), in.nseg, in.requested_blocks);
  p.neutral = neutral;
}

template <class scalar_t, class acc_t>
void launch_forward(FwdParams<scalar_t, acc_t>& p, const at::Tensor& like) {
  auto stream = at::cuda::getCurrentCUDAStream();
  if (p.blocks_per_seg == 1) {
    fused_fwd_kernel<scalar_t, acc_t><<<p.nseg, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t grid = p.nseg * p.blocks_per_seg;
  const bool one = p.iters == 1;  // the first pass also takes the unstabilised sums
  Workspace ws;
  ws.reserve<FwdSeg>(p.nseg);
  if (one) {
    ws.reserve<FirstPart>(grid);
  } else {
    ws.reserve<MinMaxBad>(grid);
  }
  ws.reserve<Pair<double>>(grid);
  ws.allocate(like);
  p.seg = ws.take<FwdSeg>(p.nseg);
  if (one) {
    p.first_part = ws.take<FirstPart>(grid);
  } else {
    p.ext_part = ws.take<MinMaxBad>(grid);
  }
  p.sum_part = ws.take<Pair<double>>(grid);
  if (one) {
    split_first_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    split_first_start_kernel<scalar_t, acc_t>
        <<<segment_blocks(p.nseg), kSegThreads, 0, stream>>>(p);
  } else {
    split_extremes_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    split_start_kernel<scalar_t, acc_t><<<segment_blocks(p.nseg), kSegThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (int64_t t = 0; t < p.iters; ++t) {
    split_sums_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    split_step_kernel<scalar_t, acc_t><<<segment_blocks(p.nseg), kSegThreads, 0, stream>>>(p, t);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  split_output_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class scalar_t, class acc_t>
void launch_backward(BwdParams<scalar_t, acc_t>& p, const at::Tensor& like) {
  auto stream = at::cuda::getCurrentCUDAStream();
  if (p.blocks_per_seg == 1) {
    fused_bwd_kernel<scalar_t, acc_t><<<p.nseg, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t grid = p.nseg * p.blocks_per_seg;
  Workspace ws;
  ws.reserve<BwdSeg>(p.nseg);
  ws.reserve<Quad<double>>(grid);
  ws.reserve<double>(grid);
  ws.allocate(like);
  p.seg = ws.take<BwdSeg>(p.nseg);
  p.quad_part = ws.take<Quad<double>>(grid);
  p.w_part = ws.take<double>(grid);
  split_bwd_sums_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  split_bwd_start_kernel<scalar_t, acc_t><<<segment_blocks(p.nseg), kSegThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (int64_t t = p.iters - 1; t >= 1; --t) {
    split_bwd_pass_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(p, t);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    split_bwd_step_kernel<scalar_t, acc_t>
        <<<segment_blocks(p.nseg), kSegThreads, 0, stream>>>(p, t);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  split_bwd_output_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_cuda_kernels(
    const at::Tensor& scores, const at::Tensor& offsets, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds, const at::Tensor& shift_in, int64_t iters,
    bool neutral, int64_t blocks_per_segment, int64_t segment_size) {
  if (use_blocks_kernels(segment_size, blocks_per_segment)) {
    return transport_mask_blocks_cuda(scores, keep, eps, log_odds, shift_in, iters, neutral,
                                      segment_size);
  }
  const InputTensors in = input_tensors(scores, offsets, keep, eps, log_odds, blocks_per_segment);
  const c10::cuda::CUDAGuard guard(scores.device());
  const auto shift = shift_in.contiguous();
  auto mask = at::empty_like(in.scores);
  const StateOutputs next = lent_or_empty_state_outputs(in.scores, in.log_odds, shift);
  const at::Tensor &new_d = next.log_odds, &new_shift = next.shift, &nonfinite = next.nonfinite;
  auto stats = at::empty({in.nseg, iters, 3}, in.log_odds.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, in.scores.scalar_type(), "transport_mask_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        FwdParams<scalar_t, acc_t> p{};
        fill_inputs(p, in, iters, neutral);
        p.shift = shift.data_ptr<acc_t>();
        p.mask = mask.data_ptr<scalar_t>();
        p.new_log_odds = new_d.data_ptr<acc_t>();
        p.new_shift = new_shift.data_ptr<acc_t>();
        p.stats = stats.data_ptr<double>();
        p.nonfinite = nonfinite.data_ptr<bool>();
        launch_forward(p, in.scores);
      });
  return {mask, new_d, new_shift, stats, nonfinite};
}

std::tuple<at::Tensor, at::Tensor> transport_mask_backward_cuda_kernels(
    const at::Tensor& grad_mask, const at::Tensor& scores, const at::Tensor& offsets,
    const at::Tensor& keep, const at::Tensor& eps, const at::Tensor& log_odds,
    const at::Tensor& stats_in, bool neutral, int64_t blocks_per_segment, int64_t segment_size) {
  if (use_blocks_kernels(segment_size, blocks_per_segment)) {  // as the forward chose
    return transport_mask_blocks_backward_cuda(grad_mask, scores, keep, eps, log_odds, stats_in,
                                               neutral, segment_size);
  }
  const InputTensors in = input_tensors(scores, offsets, keep, eps, log_odds, blocks_per_segment);
  const c10::cuda::CUDAGuard guard(scores.device());
  const auto stats = stats_in.contiguous();
  const auto g = contiguous_as(grad_mask, in.log_odds.scalar_type());
  const int64_t iters = stats.size(1);
  auto grad_scores = at::empty_like(in.scores);
  auto grad_keep = at::empty({in.nseg}, in.keep.values.options());  // float32 or float64
  // The chain's coefficients exist from two passes on (the paper's one pass has none).
  auto coef = iters > 1
                  ? at::empty({in.nseg * (iters - 1)}, in.log_odds.options().dtype(at::kDouble))
                  : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, in.scores.scalar_type(), "transport_mask_backward_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        BwdParams<scalar_t, acc_t> p{};
        fill_inputs(p, in, iters, neutral);
        p.grad_mask = g.data_ptr<acc_t>();
        p.stats = stats.data_ptr<double>();
        p.coef = coef.defined() ? coef.data_ptr<double>() : nullptr;
        p.grad_scores = grad_scores.data_ptr<scalar_t>();
        p.grad_keep = grad_keep.data_ptr();
        launch_backward(p, in.scores);
      });
  return {grad_scores, grad_keep.scalar_type() == keep.scalar_type()
                           ? grad_keep
                           : grad_keep.to(keep.scalar_type())};
}

}  // namespace dtp
