// The transport-mask step for segments that all have one small size M (4, 8 or 16): the
// blocks of N:M sparsity. A tile is L consecutive segments, each M consecutive elements
// (no offsets are read), whose whole step (every pass, the mask, the next state; in the
// backward every sum and the gradient) runs in local arrays laid out [element][segment].
// Shared by the CPU kernels (transport_mask_blocks_cpu.cpp: L = 32 for M = 4 and 16
// otherwise, the loops vectorised across the segments, and L = 1 for the last segments)
// and the CUDA kernels (transport_mask_blocks_cuda.cu: L = 1, one thread per segment).
// The math is that of docs/design.md section 1, with one difference in the stabilising
// shifts: the column maxima are taken as min(z_max, 0) and min(-z_min, 0) (within log 2 of
// the exact log-sigmoids), which cancel in the result. Which sums a tile takes (the
// unstabilised first sums, the one-exp or the general form) is decided for the whole
// tile, so a segment's result depends on L; for a fixed L it is bitwise reproducible.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "transport_blocks_rows.h"
#include "transport_math.h"

namespace dtp {
namespace blocks {

// exp(kMinScaledShift) as a double (a literal: std::exp is not available on the device).
constexpr double kMinScaledTerm = 8.75651076269652e-27;

// Where value c (0: the shift a pass used, 1: L1, 2: L0) of pass t of segment seg is in
// the stats: the op's (nseg, iters, 3) tensor laid out (iters, 3, nseg) in memory, so a
// tile's values of one kind are consecutive (vector stores and loads on the CPU,
// coalesced on the GPU).
DTP_HOST_DEVICE inline int64_t stats_at(int64_t nseg, int64_t t, int c, int64_t seg) {
  return (t * 3 + c) * nseg + seg;
}

// 1 where k is outside (0, M) (NaN included): the segment's mask is the constant k / M;
// else 0. The tiles' per-segment tests are selects between T values, not bools joined by
// && or || (short-circuit branches the compiler must keep).
template <int M, class T>
DTP_HOST_DEVICE inline T degenerate_flag(T k) {
  // two flat selects and a sum: GCC if-converts these where the nested form stayed a branch
  return (k > T(0) ? T(0) : T(1)) + (k < T(M) ? T(0) : T(1)) > T(0) ? T(1) : T(0);
}

struct BlocksForwardArgs {
  const void* scores;
  const void* keep;  // acc_t
  const double* eps;
  int64_t keep_stride;  // 1: one keep per segment; 0: one for all (common.h: per_segment)
  int64_t eps_stride;
  const void* log_odds;
  const void* shift;
  void* mask;  // acc_t
  void* new_log_odds;
  void* new_shift;
  void* stats;  // in T: shift used, L1, L0 of each pass (stats_at)
  bool* nonfinite;
  int64_t nseg;
  int64_t iters;
  bool neutral;
  bool aligned;  // scores (if float32), log-odds, mask and next log-odds 16-byte aligned
};

template <int M, int L, class T>
struct TileInputs {
  T x[M][L];
  T ok[M][L];  // 1 where the score is finite, else 0
  T d[M][L];
  T k[L], inv_eps[L];
};

// The tile's k and 1 / eps: one value per segment (stride 1) or one for all (stride 0,
// read once; a branch per tile, so each loop stays a plain vector load).
template <int L, class T>
DTP_HOST_DEVICE inline void load_segment_values(const T* keep, int64_t keep_stride,
                                                const double* eps, int64_t eps_stride, int64_t seg0,
                                                T* k, T* inv_eps) {
  if (keep_stride == 0) {
    for (int l = 0; l < L; ++l) k[l] = keep[0];
  } else {
    for (int l = 0; l < L; ++l) k[l] = keep[seg0 + l];
  }
  if (eps_stride == 0) {
    const T inv = static_cast<T>(1.0 / eps[0]);
    for (int l = 0; l < L; ++l) inv_eps[l] = inv;
  } else {
    for (int l = 0; l < L; ++l) inv_eps[l] = static_cast<T>(1.0 / eps[seg0 + l]);
  }
}

// A tile's values ([element][segment]) stored in segment order at dst.
template <int M, int L, class T>
DTP_HOST_DEVICE inline void store_segments(T* dst, const T (&values)[M][L]) {
  for (int l = 0; l < L; ++l) {
    for (int j = 0; j < M; ++j) dst[l * M + j] = values[j][l];
  }
}

// The tile's bias log(k / (M - k)) (0 for a degenerate segment): one log per segment, or
// one for the tile when every segment shares k (stride 0, as N:M pruning passes it).
template <int M, class T>
DTP_HOST_DEVICE inline T bias_of(T k) {
  return degenerate_flag<M>(k) != T(0) ? T(0) : log_fast(k / (T(M) - k));
}
template <int M, int L, class T>
DTP_HOST_DEVICE inline void segment_bias(const T* k, int64_t keep_stride, T* bias) {
  if (keep_stride == 0) {
    const T b = bias_of<M>(k[0]);
    for (int l = 0; l < L; ++l) bias[l] = b;
  } else {
    for (int l = 0; l < L; ++l) bias[l] = bias_of<M>(k[l]);
  }
}

// x_i = d_i + (2 s_i - 1) / eps for the tile of segments starting at seg0 (in.k and
// in.inv_eps already loaded).
template <int M, int L, class scalar_t, class T>
DTP_HOST_DEVICE inline void load_tile(const scalar_t* scores, const T* log_odds, int64_t seg0,
                                      bool neutral, bool aligned, TileInputs<M, L, T>& in) {
  T raw[M][L];  // the scores, and in.d the log-odds, in the tile's layout
  if constexpr (row_access<M, L, T>() && std::is_same_v<scalar_t, float>) {
    if (aligned) {
      load_row(scores + seg0 * M, raw);
      load_row(log_odds + seg0 * M, in.d);
    } else {
      for (int j = 0; j < M; ++j) {
        raw[j][0] = scores[seg0 * M + j];
        in.d[j][0] = log_odds[seg0 * M + j];
      }
    }
  } else {
    for (int l = 0; l < L; ++l) {
      for (int j = 0; j < M; ++j) {
        const int64_t i = (seg0 + l) * M + j;
        raw[j][l] = static_cast<T>(scores[i]);
        in.d[j][l] = log_odds[i];
      }
    }
  }
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < L; ++l) {
      const bool ok = raw[j][l] - raw[j][l] == T(0);  // raw - raw is NaN for inf and NaN
      const T si = (neutral && !ok) ? T(0.5) : raw[j][l];
      in.ok[j][l] = ok ? T(1) : T(0);
      in.x[j][l] = in.d[j][l] + (T(2) * si - T(1)) * in.inv_eps[l];
    }
  }
}

// The one-iteration tile's column sums without a stabiliser (every term is a sigmoid in
// (0, 1], so nothing overflows): the terms, s1 and the updated shift and stats row when
// every segment of the tile is finite and no column sums below M e^-60; else false, and
// the caller takes the stabilised sums. `bad` is 0 for every segment when it returns true.
template <int M, int L, class T>
DTP_HOST_DEVICE inline bool first_sums_tile(const BlocksForwardArgs& a, int64_t seg0,
                                            const TileInputs<M, L, T>& in, const T* bias, T* delta,
                                            T (&terms)[M][L], T* s1, T* bad) {
  T s0[L], flaw[L];
  for (int l = 0; l < L; ++l) {
    s1[l] = 0;
    s0[l] = 0;
    flaw[l] = 0;
  }
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < L; ++l) {
      const T v = in.x[j][l], z = v + delta[l];
      flaw[l] += (T(1) - in.ok[j][l]) + (v - v);  // 0, or not once an s or x is inf or NaN
      const auto parts = sigmoid_parts(z);
      terms[j][l] = scaled_sigmoid(z, parts, T(1));
      s1[l] += terms[j][l];
      s0[l] += scaled_sigmoid_neg(z, parts, T(1));
    }
  }
  const T least = T(M) * T(kMinScaledTerm);
  int fails = 0;  // an integer: a float sum would not vectorise (order); NaN sums fail too
  for (int l = 0; l < L; ++l) {
    fails |= flaw[l] == T(0) ? 0 : 1;
    fails |= s1[l] >= least ? 0 : 1;
    fails |= s0[l] >= least ? 0 : 1;
  }
  if (fails != 0) return false;
  T* stats = static_cast<T*>(a.stats);
  T l1[L], l0[L];
  for (int l = 0; l < L; ++l) {
    l1[l] = log_of_normal(s1[l]);  // both sums are finite and >= M e^-60 (above)
    l0[l] = log_of_normal(s0[l]);
  }
  copy_out<L>(stats + stats_at(a.nseg, 0, 0, seg0), delta);
  copy_out<L>(stats + stats_at(a.nseg, 0, 1, seg0), l1);
  copy_out<L>(stats + stats_at(a.nseg, 0, 2, seg0), l0);
  for (int l = 0; l < L; ++l) {
    delta[l] = bias[l] + delta[l] - l1[l] + l0[l];
    bad[l] = 0;
  }
  return true;
}

template <int M, int L, class scalar_t, class T>
DTP_HOST_DEVICE inline void forward_tile(const BlocksForwardArgs& a, int64_t seg0) {
  TileInputs<M, L, T> in;
  const T* shift_in = static_cast<const T*>(a.shift) + seg0;
  load_segment_values<L>(static_cast<const T*>(a.keep), a.keep_stride, a.eps, a.eps_stride, seg0,
                         in.k, in.inv_eps);
  load_tile<M, L, scalar_t, T>(static_cast<const scalar_t*>(a.scores),
                               static_cast<const T*>(a.log_odds), seg0, a.neutral, a.aligned, in);
  T xmax[L], xmin[L], bad[L], bias[L], delta[L];
  segment_bias<M, L>(in.k, a.keep_stride, bias);
  for (int l = 0; l < L; ++l) {
    delta[l] = shift_in[l];
    xmax[l] = -INFINITY;
    xmin[l] = INFINITY;
    bad[l] = 0;
  }
  T terms[M][L], s1[L] = {};  // (set by every path below; iters >= 1)
  // One iteration (the paper's step): the column sums without a stabiliser, as the
  // general kernels take them (transport_mask_cpu.cpp, first_sums_loop); they stand when
  // every segment of the tile is finite and no column's mean term is below e^-60.
  const bool first =
      a.iters == 1 && first_sums_tile<M, L, T>(a, seg0, in, bias, delta, terms, s1, bad);
  if (!first) {
    for (int j = 0; j < M; ++j) {
      for (int l = 0; l < L; ++l) {
        const T v = in.x[j][l];
        bad[l] += (in.ok[j][l] == T(1) && v - v == T(0)) ? T(0) : T(1);
        xmax[l] = v > xmax[l] ? v : xmax[l];
        xmin[l] = v < xmin[l] ? v : xmin[l];
      }
    }
    for (int64_t t = 0; t < a.iters; ++t) {
      T dl[L], m1[L], m0[L], s0[L];
      T lowest = 0;
      for (int l = 0; l < L; ++l) {
        dl[l] = delta[l];
        const T hi = min_zero(xmax[l] + dl[l]), lo = min_zero(-(xmin[l] + dl[l]));
        m1[l] = hi - hi == T(0) ? hi : T(0);  // non-finite segment: its state is kept
        m0[l] = lo - lo == T(0) ? lo : T(0);
        const T least_shift = m0[l] < m1[l] ? m0[l] : m1[l];  // std::min, also on the device
        lowest = least_shift < lowest ? least_shift : lowest;
        s1[l] = 0;
        s0[l] = 0;
      }
      if (lowest >= T(kMinScaledShift)) {  // one exp per element (transport_math.h)
        T c1[L], c0[L];
        for (int l = 0; l < L; ++l) {
          c1[l] = exp_fast(-m1[l]);
          c0[l] = exp_fast(-m0[l]);
        }
        for (int j = 0; j < M; ++j) {
          for (int l = 0; l < L; ++l) {
            const T z = in.x[j][l] + dl[l];
            const auto parts = sigmoid_parts(z);
            terms[j][l] = scaled_sigmoid(z, parts, c1[l]);
            s1[l] += terms[j][l];
            s0[l] += scaled_sigmoid_neg(z, parts, c0[l]);
          }
        }
      } else {
        for (int j = 0; j < M; ++j) {
          for (int l = 0; l < L; ++l) {
            const T z = in.x[j][l] + dl[l];
            const T r = sigmoid_abs(z);
            terms[j][l] = exp_log_sigmoid(z, m1[l], r);
            s1[l] += terms[j][l];
            s0[l] += exp_log_sigmoid(-z, m0[l], r);
          }
        }
      }
      T l1[L], l0[L];
      for (int l = 0; l < L; ++l) {
        l1[l] = m1[l] + log_fast(s1[l]);
        l0[l] = m0[l] + log_fast(s0[l]);
        delta[l] = bias[l] + dl[l] - l1[l] + l0[l];
      }
      T* stats = static_cast<T*>(a.stats);
      copy_out<L>(stats + stats_at(a.nseg, t, 0, seg0), dl);
      copy_out<L>(stats + stats_at(a.nseg, t, 1, seg0), l1);
      copy_out<L>(stats + stats_at(a.nseg, t, 2, seg0), l0);
    }
  }

  // Everything below is formed in local arrays first and stored in separate loops, so
  // the stores cannot alias the loads. The per-segment values are flat selects between T
  // values (no bool), one small loop each: so GCC vectorises them across the tile's
  // segments (as one loop with nested selects they stayed scalar, "control flow in loop").
  T scale[L], constant[L], next[L], shift_out[L], flag[L], degenerate[L];
#pragma omp simd
  for (int l = 0; l < L; ++l) degenerate[l] = degenerate_flag<M>(in.k[l]);
#pragma omp simd
  for (int l = 0; l < L; ++l) {
    // bad counts non-finite inputs (0 on the first-sums path); a NaN or inf next shift
    // is held too
    const T held = bad[l] + (delta[l] - delta[l] == T(0) ? T(0) : T(1));
    flag[l] = held > T(0) ? T(1) : T(0);
  }
#pragma omp simd
  for (int l = 0; l < L; ++l) {
    next[l] = degenerate[l] + flag[l] == T(0) ? T(1) : T(0);  // 1: the segment's state advances
  }
#pragma omp simd
  for (int l = 0; l < L; ++l) scale[l] = in.k[l] / s1[l];
#pragma omp simd
  for (int l = 0; l < L; ++l) {
    // mask_i = k P[i, 1] = k t_i / sum_j t_j, or the constant k / M of a degenerate one
    // (M is a power of two: k * (1 / M) is k / M exactly)
    constant[l] = degenerate[l] != T(0) ? in.k[l] * T(1.0 / M) : T(-1);  // -1: not degenerate
  }
#pragma omp simd
  for (int l = 0; l < L; ++l) shift_out[l] = next[l] == T(1) ? delta[l] : shift_in[l];
  T mask_t[M][L], d_t[M][L];
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < L; ++l) {
      mask_t[j][l] = constant[l] >= T(0) ? constant[l] : terms[j][l] * scale[l];
      d_t[j][l] = next[l] == T(1) ? in.x[j][l] + delta[l] : in.d[j][l];
    }
  }
  // Per-segment outputs are copied out whole from local arrays (transport_blocks_rows.h:
  // copy_out); the elements' as whole rows (aligned one-segment tiles) or in segment order.
  bool held_out[L];
  for (int l = 0; l < L; ++l) held_out[l] = flag[l] != T(0);
  copy_out<L>(a.nonfinite + seg0, held_out);
  copy_out<L>(static_cast<T*>(a.new_shift) + seg0, shift_out);
  if constexpr (row_access<M, L, T>()) {
    if (a.aligned) {
      store_row(static_cast<T*>(a.mask) + seg0 * M, mask_t);
      store_row(static_cast<T*>(a.new_log_odds) + seg0 * M, d_t);
      return;
    }
  }
  store_segments(static_cast<T*>(a.mask) + seg0 * M, mask_t);
  store_segments(static_cast<T*>(a.new_log_odds) + seg0 * M, d_t);
}

struct BlocksBackwardArgs {
  const void* grad_mask;  // acc_t
  const void* scores;
  const void* keep;  // acc_t
  const double* eps;
  int64_t keep_stride;  // as in BlocksForwardArgs
  int64_t eps_stride;
  const void* log_odds;
  const void* stats;  // T, as the forward wrote them (stats_at)
  void* grad_scores;  // acc_t
  void* grad_keep;    // acc_t: the sums are formed in it
  int64_t nseg;
  int64_t iters;
  bool neutral;
  bool aligned;  // grad_mask, scores (if float32), log-odds and grad_scores 16-byte aligned
};

// The tile's backward (docs/design.md section 2): the last pass gives
// dL/dz = k q (g - sum g p); earlier passes add their terms through the shift.
template <int M, int L, class scalar_t, class T>
DTP_HOST_DEVICE inline void backward_tile(const BlocksBackwardArgs& a, int64_t seg0) {
  TileInputs<M, L, T> in;
  load_segment_values<L>(static_cast<const T*>(a.keep), a.keep_stride, a.eps, a.eps_stride, seg0,
                         in.k, in.inv_eps);
  load_tile<M, L, scalar_t, T>(static_cast<const scalar_t*>(a.scores),
                               static_cast<const T*>(a.log_odds), seg0, a.neutral, a.aligned, in);
  const T* gm = static_cast<const T*>(a.grad_mask) + seg0 * M;
  T g[M][L], rows[3][L];
  if constexpr (row_access<M, L, T>()) {
    if (a.aligned) {
      load_row(gm, g);
    } else {
      for (int j = 0; j < M; ++j) g[j][0] = gm[j];
    }
  } else {
    for (int l = 0; l < L; ++l) {
      for (int j = 0; j < M; ++j) g[j][l] = gm[l * M + j];
    }
  }
  // The first `columns` entries of pass t's rows: the last pass needs no L0.
  auto read_rows = [&](int64_t t, int columns) {
    const T* stats = static_cast<const T*>(a.stats);
    for (int c = 0; c < columns; ++c) {
      for (int l = 0; l < L; ++l) rows[c][l] = stats[stats_at(a.nseg, t, c, seg0 + l)];
    }
  };
  read_rows(a.iters - 1, 2);
  T q[M][L], gp[L], gq[L], qs[L], gs[L];
  // The one-exp form when every L1 of the tile is >= 0 (a NaN row fails: the general
  // form). An integer flag: the loop vectorises.
  int below = 0;
  for (int l = 0; l < L; ++l) {
    gp[l] = gq[l] = qs[l] = gs[l] = 0;
    below |= rows[1][l] >= T(0) ? 0 : 1;
  }
  if (below == 0) {  // one exp per element (transport_math.h)
    T c[L];
    for (int l = 0; l < L; ++l) c[l] = exp_fast(-rows[1][l]);
    for (int j = 0; j < M; ++j) {
      for (int l = 0; l < L; ++l) {
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
      for (int l = 0; l < L; ++l) {
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
  T grad[M][L], gdelta[L], grad_bias[L];
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < L; ++l) grad[j][l] = in.k[l] * q[j][l] * (g[j][l] - gp[l]);
  }
  for (int l = 0; l < L; ++l) {
    gdelta[l] = in.k[l] * (gq[l] - gp[l] * qs[l]);
    grad_bias[l] = 0;
  }
  // Earlier passes: d delta_t / d x_i = -w_i(t), d delta_t / d delta_{t-1} = 1 - W_t.
  for (int64_t t = a.iters - 2; t >= 0; --t) {
    read_rows(t, 3);
    T wsum[L] = {};
    for (int j = 0; j < M; ++j) {
      for (int l = 0; l < L; ++l) {
        const T z = in.x[j][l] + rows[0][l];
        const T r = sigmoid_abs(z);
        const T w = exp_log_sigmoid_pair(z, rows[1][l], r) + exp_log_sigmoid_pair(z, rows[2][l], r);
        grad[j][l] -= gdelta[l] * w;
        wsum[l] += w;
      }
    }
    for (int l = 0; l < L; ++l) {
      grad_bias[l] += gdelta[l];
      gdelta[l] *= T(1) - wsum[l];
    }
  }
  T to_scores[L], keep_grad[L];
#pragma omp simd
  for (int l = 0; l < L; ++l) {
    const T k = in.k[l];
    const T degenerate = degenerate_flag<M>(k);
    to_scores[l] = degenerate != T(0) ? T(-1) : T(2) * in.inv_eps[l];  // -1: no gradient
    keep_grad[l] =
        degenerate != T(0) ? gs[l] / T(M) : gp[l] + grad_bias[l] * T(M) / (k * (T(M) - k));
  }
  copy_out<L>(static_cast<T*>(a.grad_keep) + seg0, keep_grad);
  // A degenerate segment (mask = k / M) and scores read as the neutral 0.5 get none. The
  // gradient is formed across segments ([element][segment], no branch: it vectorises),
  // then stored in segment order.
  const T neutral = a.neutral ? T(1) : T(0);
  T out[M][L];
  for (int j = 0; j < M; ++j) {
    for (int l = 0; l < L; ++l) {
      const T zero = to_scores[l] < T(0) ? T(1) : neutral * (T(1) - in.ok[j][l]);
      out[j][l] = zero != T(0) ? T(0) : grad[j][l] * to_scores[l];
    }
  }
  if constexpr (row_access<M, L, T>()) {
    if (a.aligned) {
      store_row(static_cast<T*>(a.grad_scores) + seg0 * M, out);
      return;
    }
  }
  store_segments(static_cast<T*>(a.grad_scores) + seg0 * M, out);
}

}  // namespace blocks
}  // namespace dtp
