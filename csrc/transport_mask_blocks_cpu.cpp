// C++ CPU kernels of the DTP transport-mask step for segments that all have the same small
// size M (4, 8 or 16): the blocks of N:M sparsity. The general kernels
// (transport_mask_cpu.cpp) cut segments into chunks and keep host vectors per segment,
// which costs more than the math when every segment has 4 elements. Here a segment is M
// consecutive elements (no offsets are read), M is a compile-time constant, and a tile of
// 16 segments runs its whole step (every pass, the mask, the next state; in the backward
// every sum and the gradient) in local arrays, its loops vectorised across the segments.
// Segments are independent and tiles fixed, so the result does not depend on threading.
// The math is that of docs/design.md section 1, with one
// difference in the stabilising shifts: the column maxima are taken as min(z_max, 0) and
// min(-z_min, 0) (within log 2 of the exact log-sigmoids), which cancel in the result.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "cpu_outputs.h"
#include "transport_blocks.h"
#include "transport_math.h"

namespace dtp {
namespace {

// Segments per parallel task, so that a task holds about 4,096 elements.
constexpr int64_t kTaskElements = 4096;
// Below this many elements the whole call runs on the calling thread.
constexpr int64_t kSerialElements = 32768;

// Segments are processed in tiles of kTile, each value held as an array over the tile's
// segments ([element][segment]), so every loop below runs across segments and vectorises
// whatever M is. A last, partial tile runs on padded copies (tail_forward, tail_backward).
constexpr int kTile = 16;

// f(first segment, end segment) over ranges of whole tiles: a tile covers the same
// segments, and runs the same code, whatever the thread count, so results are bitwise
// independent of it.
template <class F>
void for_each_segment_range(int64_t nseg, int64_t m, const F& f) {
  const int64_t tiles = (nseg + kTile - 1) / kTile;
  const int64_t per_task = std::max<int64_t>(kTaskElements / (m * kTile), 1);
  const int64_t grain = nseg * m < kSerialElements ? std::max<int64_t>(tiles, 1) : per_task;
  at::parallel_for(0, tiles, grain,
                   [&](int64_t lo, int64_t hi) { f(lo * kTile, std::min(hi * kTile, nseg)); });
}

// A kept count and eps a segment accepts: 0 <= k <= M, eps finite and > 0 (false for NaN).
DTP_INLINE bool valid_segment(double k, double eps, int64_t m) {
  return (k >= 0.0) & (k <= static_cast<double>(m)) & (eps > 0.0) & (eps < INFINITY);
}

// 1 where k is outside (0, M) (NaN included): the segment's mask is the constant k / M;
// else 0. The tiles' per-segment tests are selects between T values, not bools joined by
// && or ||, which GCC leaves as scalar branches: this way the loops vectorise.
template <int M, class T>
DTP_INLINE T degenerate_flag(T k) {
  return k > T(0) ? (k < T(M) ? T(0) : T(1)) : T(1);
}

struct BlocksForwardArgs {
  const void* scores;
  const void* keep;  // acc_t, one per segment
  const double* eps;
  const void* log_odds;
  const void* shift;
  void* mask;  // acc_t
  void* new_log_odds;
  void* new_shift;
  double* stats;  // (segment, pass, 3): shift used, L1, L0
  bool* nonfinite;
  int64_t iters;
  bool neutral;
};

template <int M, class T>
struct TileInputs {
  T x[M][kTile];
  T ok[M][kTile];  // 1 where the score is finite, else 0
  T d[M][kTile];
  T k[kTile], inv_eps[kTile];
};

// x_i = d_i + (2 s_i - 1) / eps for the tile of segments starting at seg0.
template <int M, class scalar_t, class T>
DTP_INLINE void load_tile(const scalar_t* scores, const T* log_odds, const T* keep,
                          const double* eps, int64_t seg0, bool neutral, TileInputs<M, T>& in) {
  for (int l = 0; l < kTile; ++l) {
    in.k[l] = keep[seg0 + l];
    in.inv_eps[l] = static_cast<T>(1.0 / eps[seg0 + l]);
  }
  for (int l = 0; l < kTile; ++l) {
    for (int j = 0; j < M; ++j) {
      const int64_t i = (seg0 + l) * M + j;
      const T raw = static_cast<T>(scores[i]);
      const bool ok = raw - raw == T(0);  // raw - raw is NaN for inf and NaN
      const T si = (neutral && !ok) ? T(0.5) : raw;
      in.ok[j][l] = ok ? T(1) : T(0);
      in.d[j][l] = log_odds[i];
      in.x[j][l] = log_odds[i] + (T(2) * si - T(1)) * in.inv_eps[l];
    }
  }
}

// The one-iteration tile's column sums without a stabiliser (every term is a sigmoid in
// (0, 1], so nothing overflows): the terms, s1 and the updated shift and stats row when
// every segment of the tile is finite and no column sums below M e^-60; else false, and
// the caller takes the stabilised sums. `bad` is 0 for every segment when it returns true.
template <int M, class T>
DTP_INLINE bool first_sums_tile(const BlocksForwardArgs& a, int64_t seg0,
                                const TileInputs<M, T>& in, const T* bias, T* delta,
                                T (&terms)[M][kTile], T* s1, T* bad) {
  T s0[kTile], flaw[kTile];
  for (int l = 0; l < kTile; ++l) {
    s1[l] = 0;
    s0[l] = 0;
    flaw[l] = 0;
  }
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < kTile; ++l) {
      const T v = in.x[j][l], z = v + delta[l];
      flaw[l] += (T(1) - in.ok[j][l]) + (v - v);  // 0, or not once an s or x is inf or NaN
      const auto parts = sigmoid_parts(z);
      terms[j][l] = scaled_sigmoid(z, parts, T(1));
      s1[l] += terms[j][l];
      s0[l] += scaled_sigmoid_neg(z, parts, T(1));
    }
  }
  const T least = T(M) * T(std::exp(kMinScaledShift));
  int fails = 0;  // an integer: a float sum would not vectorise (order); NaN sums fail too
  for (int l = 0; l < kTile; ++l) {
    fails |= flaw[l] == T(0) ? 0 : 1;
    fails |= s1[l] >= least ? 0 : 1;
    fails |= s0[l] >= least ? 0 : 1;
  }
  if (fails != 0) return false;
  for (int l = 0; l < kTile; ++l) {
    const T l1 = log_fast(s1[l]), l0 = log_fast(s0[l]);
    double* row = a.stats + (seg0 + l) * 3;
    row[0] = static_cast<double>(delta[l]);
    row[1] = static_cast<double>(l1);
    row[2] = static_cast<double>(l0);
    delta[l] = bias[l] + delta[l] - l1 + l0;
    bad[l] = 0;
  }
  return true;
}

template <int M, class scalar_t, class T>
DTP_INLINE void forward_tile(const BlocksForwardArgs& a, int64_t seg0) {
  TileInputs<M, T> in;
  const T* shift_in = static_cast<const T*>(a.shift) + seg0;
  load_tile<M, scalar_t, T>(static_cast<const scalar_t*>(a.scores),
                            static_cast<const T*>(a.log_odds), static_cast<const T*>(a.keep), a.eps,
                            seg0, a.neutral, in);
  T xmax[kTile], xmin[kTile], bad[kTile], bias[kTile], delta[kTile];
  for (int l = 0; l < kTile; ++l) {
    const T k = in.k[l];
    bias[l] = degenerate_flag<M>(k) != T(0) ? T(0) : log_fast(k) - log_fast(T(M) - k);
    delta[l] = shift_in[l];
    xmax[l] = -INFINITY;
    xmin[l] = INFINITY;
    bad[l] = 0;
  }
  T terms[M][kTile], s1[kTile];
  // One iteration (the paper's step): the column sums without a stabiliser, as the
  // general kernels take them (transport_mask_cpu.cpp, first_sums_loop); they stand when
  // every segment of the tile is finite and no column's mean term is below e^-60.
  const bool first =
      a.iters == 1 && first_sums_tile<M, T>(a, seg0, in, bias, delta, terms, s1, bad);
  if (!first) {
    for (int j = 0; j < M; ++j) {
      for (int l = 0; l < kTile; ++l) {
        const T v = in.x[j][l];
        bad[l] += (in.ok[j][l] == T(1) && v - v == T(0)) ? T(0) : T(1);
        xmax[l] = v > xmax[l] ? v : xmax[l];
        xmin[l] = v < xmin[l] ? v : xmin[l];
      }
    }
    for (int64_t t = 0; t < a.iters; ++t) {
      T dl[kTile], m1[kTile], m0[kTile], s0[kTile];
      T lowest = 0;
      for (int l = 0; l < kTile; ++l) {
        dl[l] = delta[l];
        const T hi = min_zero(xmax[l] + dl[l]), lo = min_zero(-(xmin[l] + dl[l]));
        m1[l] = hi - hi == T(0) ? hi : T(0);  // non-finite segment: its state is kept
        m0[l] = lo - lo == T(0) ? lo : T(0);
        lowest = std::min(lowest, std::min(m1[l], m0[l]));
        s1[l] = 0;
        s0[l] = 0;
      }
      if (lowest >= T(kMinScaledShift)) {  // one exp per element (transport_math.h)
        T c1[kTile], c0[kTile];
        for (int l = 0; l < kTile; ++l) {
          c1[l] = exp_fast(-m1[l]);
          c0[l] = exp_fast(-m0[l]);
        }
        for (int j = 0; j < M; ++j) {
          for (int l = 0; l < kTile; ++l) {
            const T z = in.x[j][l] + dl[l];
            const auto parts = sigmoid_parts(z);
            terms[j][l] = scaled_sigmoid(z, parts, c1[l]);
            s1[l] += terms[j][l];
            s0[l] += scaled_sigmoid_neg(z, parts, c0[l]);
          }
        }
      } else {
        for (int j = 0; j < M; ++j) {
          for (int l = 0; l < kTile; ++l) {
            const T z = in.x[j][l] + dl[l];
            const T r = sigmoid_abs(z);
            terms[j][l] = exp_log_sigmoid(z, m1[l], r);
            s1[l] += terms[j][l];
            s0[l] += exp_log_sigmoid(-z, m0[l], r);
          }
        }
      }
      T l1[kTile], l0[kTile];
      for (int l = 0; l < kTile; ++l) {
        l1[l] = m1[l] + log_fast(s1[l]);
        l0[l] = m0[l] + log_fast(s0[l]);
        delta[l] = bias[l] + dl[l] - l1[l] + l0[l];
      }
      for (int l = 0; l < kTile; ++l) {
        double* row = a.stats + ((seg0 + l) * a.iters + t) * 3;
        row[0] = static_cast<double>(dl[l]);
        row[1] = static_cast<double>(l1[l]);
        row[2] = static_cast<double>(l0[l]);
      }
    }
  }

  // Everything below is formed in local arrays first and stored in separate loops: the
  // stores cannot then alias the loads, and every loop vectorises without branches.
  T scale[kTile], constant[kTile], next[kTile], shift_out[kTile], flag[kTile];
  for (int l = 0; l < kTile; ++l) {
    const T k = in.k[l];
    const T degenerate = degenerate_flag<M>(k);
    const T nonfinite = bad[l] == T(0) ? (delta[l] - delta[l] == T(0) ? T(0) : T(1)) : T(1);
    const bool advance = degenerate + nonfinite == T(0);
    const T previous = shift_in[l];  // loaded unconditionally: a select, not a branch
    flag[l] = nonfinite;
    shift_out[l] = advance ? delta[l] : previous;
    // mask_i = k P[i, 1] = k t_i / sum_j t_j, or the constant k / M of a degenerate one
    scale[l] = k / s1[l];
    constant[l] = degenerate != T(0) ? k / T(M) : T(-1);  // -1: not degenerate (mask >= 0)
    next[l] = advance ? T(1) : T(0);
  }
  T mask_t[M][kTile], d_t[M][kTile];
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < kTile; ++l) {
      mask_t[j][l] = constant[l] >= T(0) ? constant[l] : terms[j][l] * scale[l];
      d_t[j][l] = next[l] == T(1) ? in.x[j][l] + delta[l] : in.d[j][l];
    }
  }
  for (int l = 0; l < kTile; ++l) {
    a.nonfinite[seg0 + l] = flag[l] != T(0);
    static_cast<T*>(a.new_shift)[seg0 + l] = shift_out[l];
  }
  T* mask = static_cast<T*>(a.mask) + seg0 * M;
  T* new_d = static_cast<T*>(a.new_log_odds) + seg0 * M;
  for (int l = 0; l < kTile; ++l) {
    for (int j = 0; j < M; ++j) mask[l * M + j] = mask_t[j][l];
  }
  for (int l = 0; l < kTile; ++l) {
    for (int j = 0; j < M; ++j) new_d[l * M + j] = d_t[j][l];
  }
}

// A tile of fewer than kTile segments: padded inputs (scores 0.5, k = M / 2, eps 1), the
// tile run on them, the real segments' results copied out.
template <int M, class scalar_t, class T>
void tail_forward(const BlocksForwardArgs& a, int64_t seg0, int64_t count) {
  scalar_t scores[kTile * M];
  T log_odds[kTile * M] = {}, keep[kTile], shift[kTile] = {}, mask[kTile * M], new_d[kTile * M],
                     new_shift[kTile];
  double eps[kTile];
  bool nonfinite[kTile];
  std::vector<double> stats(kTile * a.iters * 3);
  for (int i = 0; i < kTile * M; ++i) scores[i] = static_cast<scalar_t>(0.5f);
  for (int l = 0; l < kTile; ++l) {
    keep[l] = T(M / 2);
    eps[l] = 1.0;
  }
  const int64_t n = count * M;
  std::copy_n(static_cast<const scalar_t*>(a.scores) + seg0 * M, n, scores);
  std::copy_n(static_cast<const T*>(a.log_odds) + seg0 * M, n, log_odds);
  std::copy_n(static_cast<const T*>(a.keep) + seg0, count, keep);
  std::copy_n(a.eps + seg0, count, eps);
  std::copy_n(static_cast<const T*>(a.shift) + seg0, count, shift);
  BlocksForwardArgs t{scores, keep,      eps,          log_odds,  shift,   mask,
                      new_d,  new_shift, stats.data(), nonfinite, a.iters, a.neutral};
  forward_tile<M, scalar_t, T>(t, 0);
  std::copy_n(mask, n, static_cast<T*>(a.mask) + seg0 * M);
  std::copy_n(new_d, n, static_cast<T*>(a.new_log_odds) + seg0 * M);
  std::copy_n(new_shift, count, static_cast<T*>(a.new_shift) + seg0);
  std::copy_n(stats.data(), count * a.iters * 3, a.stats + seg0 * a.iters * 3);
  std::copy_n(nonfinite, count, a.nonfinite + seg0);
}

template <int M, class scalar_t, class T>
DTP_INLINE void tiles_loop(const BlocksForwardArgs& a, int64_t lo, int64_t hi) {
  int64_t seg = lo;
  for (; seg + kTile <= hi; seg += kTile) forward_tile<M, scalar_t, T>(a, seg);
  if (seg < hi) tail_forward<M, scalar_t, T>(a, seg, hi - seg);
}

struct BlocksBackwardArgs {
  const void* grad_mask;  // acc_t
  const void* scores;
  const void* keep;  // acc_t
  const double* eps;
  const void* log_odds;
  const double* stats;
  void* grad_scores;  // acc_t
  void* grad_keep;    // acc_t: the sums are formed in it
  int64_t iters;
  bool neutral;
};

// The tile's backward (docs/design.md section 2): the last pass gives
// dL/dz = k q (g - sum g p); earlier passes add their terms through the shift.
template <int M, class scalar_t, class T>
DTP_INLINE void backward_tile(const BlocksBackwardArgs& a, int64_t seg0) {
  TileInputs<M, T> in;
  load_tile<M, scalar_t, T>(static_cast<const scalar_t*>(a.scores),
                            static_cast<const T*>(a.log_odds), static_cast<const T*>(a.keep), a.eps,
                            seg0, a.neutral, in);
  const T* gm = static_cast<const T*>(a.grad_mask) + seg0 * M;
  T g[M][kTile], rows[3][kTile];
  for (int l = 0; l < kTile; ++l) {
    for (int j = 0; j < M; ++j) g[j][l] = gm[l * M + j];
  }
  auto read_rows = [&](int64_t t) {
    for (int l = 0; l < kTile; ++l) {
      const double* row = a.stats + ((seg0 + l) * a.iters + t) * 3;
      for (int c = 0; c < 3; ++c) rows[c][l] = static_cast<T>(row[c]);
    }
  };
  read_rows(a.iters - 1);
  T q[M][kTile], gp[kTile], gq[kTile], qs[kTile], gs[kTile];
  T lowest = 0;  // (NaN rows fail the test below and take the general form)
  for (int l = 0; l < kTile; ++l) {
    gp[l] = gq[l] = qs[l] = gs[l] = 0;
    lowest = rows[1][l] < lowest || rows[1][l] != rows[1][l] ? T(-INFINITY) : lowest;
  }
  if (lowest >= T(kMinScaledShift)) {  // one exp per element (transport_math.h)
    T c[kTile];
    for (int l = 0; l < kTile; ++l) c[l] = exp_fast(-rows[1][l]);
    for (int j = 0; j < M; ++j) {
      for (int l = 0; l < kTile; ++l) {
        const T z = in.x[j][l] + rows[0][l];
        const auto parts = sigmoid_parts(z);
        const T p = scaled_sigmoid(z, parts, c[l]);
        q[j][l] = scaled_sigmoid_pair(parts, c[l]);
        gp[l] += g[j][l] * p;
        gq[l] += g[j][l] * q[j][l];
        qs[l] += q[j][l];
        gs[l] += g[j][l];
      }
    }
  } else {
    for (int j = 0; j < M; ++j) {
      for (int l = 0; l < kTile; ++l) {
        const T z = in.x[j][l] + rows[0][l];
        const T r = sigmoid_abs(z);
        const T p = exp_log_sigmoid(z, rows[1][l], r);
        q[j][l] = exp_log_sigmoid_pair(z, rows[1][l], r);
        gp[l] += g[j][l] * p;
        gq[l] += g[j][l] * q[j][l];
        qs[l] += q[j][l];
        gs[l] += g[j][l];
      }
    }
  }
  T grad[M][kTile], gdelta[kTile], grad_bias[kTile];
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < kTile; ++l) grad[j][l] = in.k[l] * q[j][l] * (g[j][l] - gp[l]);
  }
  for (int l = 0; l < kTile; ++l) {
    gdelta[l] = in.k[l] * (gq[l] - gp[l] * qs[l]);
    grad_bias[l] = 0;
  }
  // Earlier passes: d delta_t / d x_i = -w_i(t), d delta_t / d delta_{t-1} = 1 - W_t.
  for (int64_t t = a.iters - 2; t >= 0; --t) {
    read_rows(t);
    T wsum[kTile] = {};
    for (int j = 0; j < M; ++j) {
      for (int l = 0; l < kTile; ++l) {
        const T z = in.x[j][l] + rows[0][l];
        const T r = sigmoid_abs(z);
        const T w = exp_log_sigmoid_pair(z, rows[1][l], r) + exp_log_sigmoid_pair(z, rows[2][l], r);
        grad[j][l] -= gdelta[l] * w;
        wsum[l] += w;
      }
    }
    for (int l = 0; l < kTile; ++l) {
      grad_bias[l] += gdelta[l];
      gdelta[l] *= T(1) - wsum[l];
    }
  }
  T to_scores[kTile];
  for (int l = 0; l < kTile; ++l) {
    const T k = in.k[l];
    const bool degenerate = degenerate_flag<M>(k) != T(0);
    to_scores[l] = degenerate ? T(-1) : T(2) * in.inv_eps[l];  // -1: degenerate, no gradient
    static_cast<T*>(a.grad_keep)[seg0 + l] =
        degenerate ? gs[l] / T(M) : gp[l] + grad_bias[l] * T(M) / (k * (T(M) - k));
  }
  // A degenerate segment (mask = k / M) and scores read as the neutral 0.5 get none. The
  // gradient is formed across segments ([element][segment], no branch: it vectorises),
  // then stored in segment order.
  const T neutral = a.neutral ? T(1) : T(0);
  T out[M][kTile];
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < kTile; ++l) {
      const T zero = to_scores[l] < T(0) ? T(1) : neutral * (T(1) - in.ok[j][l]);
      out[j][l] = zero != T(0) ? T(0) : grad[j][l] * to_scores[l];
    }
  }
  T* grad_scores = static_cast<T*>(a.grad_scores) + seg0 * M;
  for (int l = 0; l < kTile; ++l) {
    for (int j = 0; j < M; ++j) grad_scores[l * M + j] = out[j][l];
  }
}

// A tile of fewer than kTile segments, on padded copies as tail_forward.
template <int M, class scalar_t, class T>
void tail_backward(const BlocksBackwardArgs& a, int64_t seg0, int64_t count) {
  scalar_t scores[kTile * M];
  T grad_mask[kTile * M] = {}, log_odds[kTile * M] = {}, keep[kTile], grad[kTile * M];
  T grad_keep[kTile];
  double eps[kTile];
  std::vector<double> stats(kTile * a.iters * 3, 0.0);
  for (int i = 0; i < kTile * M; ++i) scores[i] = static_cast<scalar_t>(0.5f);
  for (int l = 0; l < kTile; ++l) {
    keep[l] = T(M / 2);
    eps[l] = 1.0;
  }
  const int64_t n = count * M;
  std::copy_n(static_cast<const T*>(a.grad_mask) + seg0 * M, n, grad_mask);
  std::copy_n(static_cast<const scalar_t*>(a.scores) + seg0 * M, n, scores);
  std::copy_n(static_cast<const T*>(a.log_odds) + seg0 * M, n, log_odds);
  std::copy_n(static_cast<const T*>(a.keep) + seg0, count, keep);
  std::copy_n(a.eps + seg0, count, eps);
  std::copy_n(a.stats + seg0 * a.iters * 3, count * a.iters * 3, stats.data());
  BlocksBackwardArgs t{grad_mask,    scores, keep,      eps,     log_odds,
                       stats.data(), grad,   grad_keep, a.iters, a.neutral};
  backward_tile<M, scalar_t, T>(t, 0);
  std::copy_n(grad, n, static_cast<T*>(a.grad_scores) + seg0 * M);
  std::copy_n(grad_keep, count, static_cast<T*>(a.grad_keep) + seg0);
}

template <int M, class scalar_t, class T>
DTP_INLINE void tiles_loop(const BlocksBackwardArgs& a, int64_t lo, int64_t hi) {
  int64_t seg = lo;
  for (; seg + kTile <= hi; seg += kTile) backward_tile<M, scalar_t, T>(a, seg);
  if (seg < hi) tail_backward<M, scalar_t, T>(a, seg, hi - seg);
}

// Entry points per (M, scores dtype, accumulate type), for the forward and the backward
// (overloaded on their arguments): float accumulation gets AVX-512/AVX2 clones, double a
// plain build.
template <int M, class scalar_t, class Args>
DTP_CLONES void tiles_f32(const Args& a, int64_t lo, int64_t hi) {
  tiles_loop<M, scalar_t, float>(a, lo, hi);
}
template <int M, class scalar_t, class Args>
void tiles_f64(const Args& a, int64_t lo, int64_t hi) {
  tiles_loop<M, scalar_t, double>(a, lo, hi);
}

// Runs the tiles of all segments, M turned into a template constant in one place.
template <class scalar_t, class Args>
void run_tiles(const Args& a, int64_t nseg, int64_t m, bool is_double) {
  for_each_segment_range(nseg, m, [&](int64_t lo, int64_t hi) {
    auto run = [&](auto size) {
      constexpr int kM = decltype(size)::value;
      is_double ? tiles_f64<kM, scalar_t>(a, lo, hi) : tiles_f32<kM, scalar_t>(a, lo, hi);
    };
    if (m == 4) {
      run(std::integral_constant<int, 4>{});
    } else if (m == 8) {
      run(std::integral_constant<int, 8>{});
    } else {
      run(std::integral_constant<int, 16>{});
    }
  });
}

// Every segment's keep in [0, M] and eps finite and > 0, checked before anything is written
// (the next state may go straight into TransportState's pending buffers): a counting loop
// that vectorises, and on a bad segment an error naming the first one and its value.
template <class T>
DTP_CLONES void check_segments(const T* keep, const double* eps, int64_t nseg, int64_t m) {
  int64_t bad = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    bad += valid_segment(static_cast<double>(keep[s]), eps[s], m) ? 0 : 1;
  }
  if (bad == 0) return;
  for (int64_t s = 0; s < nseg; ++s) {
    const double k = static_cast<double>(keep[s]), e = eps[s];
    if (valid_segment(k, e, m)) continue;
    TORCH_CHECK(k >= 0.0 && k <= static_cast<double>(m), "dtp::transport_mask: keep[", s, "] = ", k,
                " is outside [0, ", m, "]");
    TORCH_CHECK(false, "dtp::transport_mask: eps[", s, "] = ", e, " must be finite and > 0");
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_blocks_cpu(
    const at::Tensor& scores_in, const at::Tensor& keep_in, const at::Tensor& eps_in,
    const at::Tensor& log_odds_in, const at::Tensor& shift_in, int64_t iters,
    bool neutral_nonfinite, int64_t m) {
  const int64_t nseg = keep_in.numel();
  const auto acc = acc_type(scores_in);
  TORCH_CHECK(eps_in.device().is_cpu() && keep_in.device().is_cpu(),
              "dtp::transport_mask: keep and eps must be CPU tensors");
  const auto scores = scores_in.contiguous();
  const auto keep = keep_in.to(acc).contiguous();
  const auto eps = eps_in.to(at::kDouble).contiguous();
  const auto log_odds = log_odds_in.contiguous();
  const auto shift = shift_in.contiguous();
  if (acc == at::kDouble) {
    check_segments(keep.data_ptr<double>(), eps.data_ptr<double>(), nseg, m);
  } else {
    check_segments(keep.data_ptr<float>(), eps.data_ptr<double>(), nseg, m);
  }
  auto mask_acc = empty_output({scores.numel()}, log_odds.options());
  auto stats = empty_output({nseg, iters, 3}, log_odds.options().dtype(at::kDouble));
  // Every check is above: what follows cannot fail half-way through a lent buffer.
  auto [new_d, new_shift, nonfinite] = take_state_outputs(scores, log_odds, shift);
  BlocksForwardArgs a{scores.data_ptr(),
                      keep.data_ptr(),
                      eps.data_ptr<double>(),
                      log_odds.data_ptr(),
                      shift.data_ptr(),
                      mask_acc.data_ptr(),
                      new_d.data_ptr(),
                      new_shift.data_ptr(),
                      stats.data_ptr<double>(),
                      nonfinite.data_ptr<bool>(),
                      iters,
                      neutral_nonfinite};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(),
                                  "transport_mask_blocks_cpu",
                                  [&] { run_tiles<scalar_t>(a, nseg, m, acc == at::kDouble); });
  auto mask =
      mask_acc.scalar_type() == scores.scalar_type() ? mask_acc : mask_acc.to(scores.scalar_type());
  return {mask, new_d, new_shift, stats, nonfinite};
}

std::tuple<at::Tensor, at::Tensor> transport_mask_blocks_backward_cpu(
    const at::Tensor& grad_mask, const at::Tensor& scores_in, const at::Tensor& keep_in,
    const at::Tensor& eps_in, const at::Tensor& log_odds_in, const at::Tensor& stats_in,
    bool neutral_nonfinite, int64_t m) {
  const int64_t nseg = keep_in.numel();
  const auto acc = acc_type(scores_in);
  const auto scores = scores_in.contiguous();
  const auto keep = keep_in.to(acc).contiguous();
  const auto eps = eps_in.to(at::kDouble).contiguous();
  const auto log_odds = log_odds_in.contiguous();
  const auto stats = stats_in.contiguous();
  const auto g = grad_mask.to(acc).contiguous();
  auto grad_x = empty_output({scores.numel()}, log_odds.options());
  auto grad_keep = empty_output({nseg}, log_odds.options());
  BlocksBackwardArgs a{g.data_ptr(),           scores.data_ptr(),    keep.data_ptr(),
                       eps.data_ptr<double>(), log_odds.data_ptr(),  stats.data_ptr<double>(),
                       grad_x.data_ptr(),      grad_keep.data_ptr(), stats.size(1),
                       neutral_nonfinite};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(),
                                  "transport_mask_blocks_backward_cpu",
                                  [&] { run_tiles<scalar_t>(a, nseg, m, acc == at::kDouble); });
  auto grad_keep_out =
      keep_in.scalar_type() == acc ? grad_keep : grad_keep.to(keep_in.scalar_type());
  return {grad_x.to(scores.scalar_type()), grad_keep_out};
}

}  // namespace dtp
