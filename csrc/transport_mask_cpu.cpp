// C++ CPU kernels of the DTP transport-mask step: all segments in one call forward and
// one backward. Segments are cut into chunks of at most kChunk elements; chunks run in
// parallel (at::parallel_for) and write their partial sums to their own slot, which are
// then merged per segment in chunk order, so the result does not depend on threading.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "common.h"
#include "cpu_outputs.h"
#include "transport_blocks.h"
#include "transport_math.h"

namespace dtp {
namespace {

constexpr int64_t kChunk = 4096;
// Below this many elements the whole call runs on the calling thread.
constexpr int64_t kSerialElements = 32768;

struct Chunk {
  int64_t seg;
  int64_t begin;
  int64_t end;
};

std::vector<Chunk> make_chunks(const int64_t* offsets, int64_t nseg) {
  std::vector<Chunk> chunks;
  for (int64_t s = 0; s < nseg; ++s) {
    for (int64_t b = offsets[s]; b < offsets[s + 1]; b += kChunk) {
      chunks.push_back({s, b, std::min(b + kChunk, offsets[s + 1])});
    }
  }
  return chunks;
}

template <class F>
void for_each_chunk(const std::vector<Chunk>& chunks, int64_t numel, const F& f) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  const int64_t grain = numel < kSerialElements ? std::max<int64_t>(n, 1) : 1;
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) f(c, chunks[c]);
  });
}

// ---- per-chunk loops over acc_t arrays (acc_t = float, or double for float64) ----
//
// Reductions keep kLanes independent partial sums (lane j takes elements i = j mod kLanes)
// that are added in a fixed order at the end: the loops vectorise without reassociating
// floating-point sums, and the result is the same on every run.

constexpr int64_t kLanes = 16;

template <class acc_t>
DTP_INLINE acc_t add_lanes(const acc_t* lanes) {
  acc_t total = 0;
  for (int64_t j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

template <class acc_t>
struct Extremes {
  acc_t lo, hi;
  bool finite;
};

// x_i = d_i + (2 s_i - 1) / eps, formed from the scores and the carried log-odds by every
// pass that reads it, never stored: a step allocates and writes no x array (for a large
// segment the allocation's page faults cost more than the arithmetic), and the forward
// and backward form it with the same code. `neutral`: a non-finite s_i enters as 0.5.
template <class scalar_t, class acc_t>
struct LogOdds {
  const scalar_t* s;
  const acc_t* d;
  acc_t inv_eps;
  bool neutral;

  DTP_INLINE acc_t raw(int64_t i) const { return static_cast<acc_t>(s[i]); }
  // raw - raw is NaN for inf and NaN
  DTP_INLINE static bool finite(acc_t v) { return v - v == acc_t(0); }
  DTP_INLINE acc_t operator[](int64_t i) const {
    const acc_t r = raw(i);
    const acc_t si = (neutral && !finite(r)) ? acc_t(0.5) : r;
    return d[i] + (acc_t(2) * si - acc_t(1)) * inv_eps;
  }
  DTP_INLINE LogOdds operator+(int64_t b) const { return {s + b, d + b, inv_eps, neutral}; }
};

// The chunk's min and max of x and whether all s and x are finite.
template <class scalar_t, class acc_t>
DTP_INLINE Extremes<acc_t> log_odds_chunk_loop(LogOdds<scalar_t, acc_t> x, int64_t n) {
  acc_t lo[kLanes], hi[kLanes], bad[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    lo[j] = INFINITY;
    hi[j] = -INFINITY;
    bad[j] = 0;
  }
  for (int64_t b = 0; b < n; b += kLanes) {
    const int64_t m = std::min(kLanes, n - b);
    for (int64_t j = 0; j < m; ++j) {
      const bool raw_ok = x.finite(x.raw(b + j));
      const acc_t v = x[b + j];
      bad[j] += (raw_ok && v - v == acc_t(0)) ? acc_t(0) : acc_t(1);
      lo[j] = v < lo[j] ? v : lo[j];
      hi[j] = v > hi[j] ? v : hi[j];
    }
  }
  Extremes<acc_t> e{lo[0], hi[0], bad[0] == 0};
  for (int64_t j = 1; j < kLanes; ++j) {
    e.lo = lo[j] < e.lo ? lo[j] : e.lo;
    e.hi = hi[j] > e.hi ? hi[j] : e.hi;
    e.finite = e.finite && bad[j] == 0;
  }
  return e;
}

template <class acc_t>
struct ColumnSums {
  acc_t s1, s0;
};

// sum_i exp(log sigmoid(z_i) - m1) and sum_i exp(log sigmoid(-z_i) - m0), z = x + delta.
// With `terms`, each exp(log sigmoid(z_i) - m1) is stored there too: the last pass's
// terms divided by their sum are the mask over k (mask_i = k t_i / sum_j t_j).
template <class scalar_t, class acc_t>
DTP_INLINE ColumnSums<acc_t> column_sums_loop(LogOdds<scalar_t, acc_t> x, int64_t n, acc_t delta,
                                              acc_t m1, acc_t m0, acc_t* terms) {
  acc_t s1[kLanes] = {}, s0[kLanes] = {};
  if (m1 >= acc_t(kMinScaledShift) && m0 >= acc_t(kMinScaledShift)) {
    const acc_t c1 = exp_fast(-m1), c0 = exp_fast(-m0);
    for (int64_t b = 0; b < n; b += kLanes) {
      const int64_t m = std::min(kLanes, n - b);
      for (int64_t j = 0; j < m; ++j) {
        const acc_t z = x[b + j] + delta;
        const auto p = sigmoid_parts(z);
        const acc_t t = scaled_sigmoid(z, p, c1);
        if (terms != nullptr) terms[b + j] = t;
        s1[j] += t;
        s0[j] += scaled_sigmoid_neg(z, p, c0);
      }
    }
  } else {
    for (int64_t b = 0; b < n; b += kLanes) {
      const int64_t m = std::min(kLanes, n - b);
      for (int64_t j = 0; j < m; ++j) {
        const acc_t z = x[b + j] + delta;
        const acc_t r = sigmoid_abs(z);
        const acc_t t = exp_log_sigmoid(z, m1, r);
        if (terms != nullptr) terms[b + j] = t;
        s1[j] += t;
        s0[j] += exp_log_sigmoid(-z, m0, r);
      }
    }
  }
  return {add_lanes(s1), add_lanes(s0)};
}

// The one-pass step's column sums without a stabiliser: sigmoid(z) and sigmoid(-z) lie
// in (0, 1], so their sums cannot overflow, and while the largest term of each column is
// at least exp(kMinScaledShift) the terms that underflow do not matter (transport_math.h).
// A column summing to n exp(kMinScaledShift) or more has such a term. The loop also
// finds whether all s and x are finite, so a segment that passes needs no extremes pass;
// one that does not is summed again with the stabilised loops. Each sigmoid(z_i) is
// stored in `terms` (the mask's numerators).
template <class acc_t>
struct FirstSums {
  acc_t s1, s0;
  bool finite;
};
template <class scalar_t, class acc_t>
DTP_INLINE FirstSums<acc_t> first_sums_loop(LogOdds<scalar_t, acc_t> x, int64_t n, acc_t delta,
                                            acc_t* terms) {
  acc_t s1[kLanes] = {}, s0[kLanes] = {}, bad[kLanes] = {};
  for (int64_t b = 0; b < n; b += kLanes) {
    const int64_t m = std::min(kLanes, n - b);
    for (int64_t j = 0; j < m; ++j) {
      const acc_t r = x.raw(b + j), v = x[b + j];
      bad[j] += (r - r) + (v - v);  // 0, or NaN once an s or x is inf or NaN: no branch
      const acc_t z = v + delta;
      const auto p = sigmoid_parts(z);
      const acc_t t1 = scaled_sigmoid(z, p, acc_t(1)), t0 = scaled_sigmoid_neg(z, p, acc_t(1));
      terms[b + j] = t1;
      s1[j] += t1;
      s0[j] += t0;
    }
  }
  return {add_lanes(s1), add_lanes(s0), add_lanes(bad) == acc_t(0)};
}

// mask_i = scale t_i (in place over the stored terms); new log-odds x_i + delta_new.
template <class scalar_t, class acc_t>
DTP_INLINE void mask_and_state_loop(LogOdds<scalar_t, acc_t> x, int64_t n, acc_t scale,
                                    acc_t delta_new, acc_t* mask, acc_t* new_d) {
  for (int64_t i = 0; i < n; ++i) {
    mask[i] *= scale;
    new_d[i] = x[i] + delta_new;
  }
}

// Backward, last pass: q_i = sigmoid(z) sigmoid(-z) / S1 (stored), and the sums
// sum g p, sum g q, sum q, sum g with p_i = sigmoid(z_i) / S1.
template <class acc_t>
struct GradSums {
  acc_t gp, gq, q, g;
};
template <class scalar_t, class acc_t>
DTP_INLINE GradSums<acc_t> grad_sums_loop(LogOdds<scalar_t, acc_t> x, const acc_t* g, int64_t n,
                                          acc_t delta, acc_t l1, acc_t* q_out) {
  acc_t gp[kLanes] = {}, gq[kLanes] = {}, qs[kLanes] = {}, gs[kLanes] = {};
  auto accumulate = [&](int64_t i, int64_t j, acc_t p, acc_t q) {
    const acc_t gi = g[i];
    q_out[i] = q;
    gp[j] += gi * p;
    gq[j] += gi * q;
    qs[j] += q;
    gs[j] += gi;
  };
  if (l1 >= acc_t(kMinScaledShift)) {
    const acc_t c = exp_fast(-l1);
    for (int64_t b = 0; b < n; b += kLanes) {
      const int64_t m = std::min(kLanes, n - b);
      for (int64_t j = 0; j < m; ++j) {
        const acc_t z = x[b + j] + delta;
        const auto parts = sigmoid_parts(z);
        accumulate(b + j, j, scaled_sigmoid(z, parts, c), scaled_sigmoid_pair(parts, c));
      }
    }
  } else {
    for (int64_t b = 0; b < n; b += kLanes) {
      const int64_t m = std::min(kLanes, n - b);
      for (int64_t j = 0; j < m; ++j) {
        const acc_t z = x[b + j] + delta;
        const acc_t r = sigmoid_abs(z);
        accumulate(b + j, j, exp_log_sigmoid(z, l1, r), exp_log_sigmoid_pair(z, l1, r));
      }
    }
  }
  return {add_lanes(gp), add_lanes(gq), add_lanes(qs), add_lanes(gs)};
}

// The same sums from the forward's mask (mask_i = k p_i): p_i = mask_i / k and
// q_i = p_i sigmoid(-z_i) = p_i (1 - S1 p_i), S1 = exp(L1), sigmoid(z_i) = S1 p_i. No exp
// or division per element, and no read of the scores and log-odds. q's absolute error is
// p_i times a rounding of 1 (where sigmoid(-z_i) is tiny, so is q_i's share of the
// gradient). inv_k is 0 for a degenerate segment, whose p and q are not used.
template <class acc_t>
DTP_INLINE GradSums<acc_t> grad_sums_from_mask_loop(const acc_t* mask, const acc_t* g, int64_t n,
                                                    acc_t inv_k, acc_t s1, acc_t* q_out) {
  acc_t gp[kLanes] = {}, gq[kLanes] = {}, qs[kLanes] = {}, gs[kLanes] = {};
  for (int64_t b = 0; b < n; b += kLanes) {
    const int64_t m = std::min(kLanes, n - b);
    for (int64_t j = 0; j < m; ++j) {
      const acc_t gi = g[b + j], p = mask[b + j] * inv_k;
      const acc_t q = p * (acc_t(1) - s1 * p);
      q_out[b + j] = q;
      gp[j] += gi * p;
      gq[j] += gi * q;
      qs[j] += q;
      gs[j] += gi;
    }
  }
  return {add_lanes(gp), add_lanes(gq), add_lanes(qs), add_lanes(gs)};
}

// Entry points: float with AVX-512/AVX2 clones, double plain (the loops inline into each).
DTP_FLOAT_CLONED(template <class scalar_t>, Extremes<T>, log_odds_chunk,
                 (LogOdds<scalar_t, T> x, int64_t n), (x, n))
DTP_FLOAT_CLONED(template <class scalar_t>, ColumnSums<T>, column_sums,
                 (LogOdds<scalar_t, T> x, int64_t n, T delta, T m1, T m0, T* terms),
                 (x, n, delta, m1, m0, terms))
DTP_FLOAT_CLONED(template <class scalar_t>, FirstSums<T>, first_sums,
                 (LogOdds<scalar_t, T> x, int64_t n, T delta, T* terms), (x, n, delta, terms))
DTP_FLOAT_CLONED(template <class scalar_t>, void, mask_and_state,
                 (LogOdds<scalar_t, T> x, int64_t n, T scale, T delta_new, T* mask, T* new_d),
                 (x, n, scale, delta_new, mask, new_d))
DTP_FLOAT_CLONED(template <class scalar_t>, GradSums<T>, grad_sums,
                 (LogOdds<scalar_t, T> x, const T* g, int64_t n, T delta, T l1, T* q_out),
                 (x, g, n, delta, l1, q_out))
DTP_FLOAT_CLONED(, GradSums<T>, grad_sums_from_mask,
                 (const T* mask, const T* g, int64_t n, T inv_k, T s1, T* q_out),
                 (mask, g, n, inv_k, s1, q_out))

// w_i = -d(L1 - L0)/dz_i of an earlier pass: sigmoid(z) sigmoid(-z) (1/S1 + 1/S0).
template <class acc_t>
DTP_INLINE acc_t pass_weight(acc_t z, acc_t l1, acc_t l0) {
  const acc_t r = sigmoid_abs(z);
  return exp_log_sigmoid_pair(z, l1, r) + exp_log_sigmoid_pair(z, l0, r);
}

template <class scalar_t, class acc_t>
DTP_INLINE acc_t pass_weight_sum_loop(LogOdds<scalar_t, acc_t> x, int64_t n, acc_t delta, acc_t l1,
                                      acc_t l0) {
  acc_t w[kLanes] = {};
  for (int64_t b = 0; b < n; b += kLanes) {
    const int64_t m = std::min(kLanes, n - b);
    for (int64_t j = 0; j < m; ++j) w[j] += pass_weight(x[b + j] + delta, l1, l0);
  }
  return add_lanes(w);
}

// grad_i = k q_i (g_i - gp) + sum_t coef_t w_i(pass t), then times 2 / eps; scores read
// as the neutral 0.5 get none. grad holds q_i on entry. With one pass (the paper's step)
// this is one loop over the chunk.
template <class scalar_t, class acc_t>
DTP_INLINE void grad_scores_loop(LogOdds<scalar_t, acc_t> x, const acc_t* g, int64_t n, acc_t k,
                                 acc_t gp, acc_t scale, const double* rows, const double* coef,
                                 int64_t npass, acc_t* grad) {
  auto finish = [&](int64_t i, acc_t v) {
    grad[i] = (x.neutral && !x.finite(x.raw(i))) ? acc_t(0) : v * scale;
  };
  if (npass == 0) {
    for (int64_t i = 0; i < n; ++i) finish(i, k * grad[i] * (g[i] - gp));
    return;
  }
  for (int64_t i = 0; i < n; ++i) grad[i] = k * grad[i] * (g[i] - gp);
  for (int64_t t = 0; t < npass; ++t) {
    const acc_t dl = static_cast<acc_t>(rows[3 * t]), a1 = static_cast<acc_t>(rows[3 * t + 1]),
                a0 = static_cast<acc_t>(rows[3 * t + 2]), a = static_cast<acc_t>(coef[t]);
    for (int64_t i = 0; i < n; ++i) grad[i] += a * pass_weight(x[i] + dl, a1, a0);
  }
  for (int64_t i = 0; i < n; ++i) finish(i, grad[i]);
}

DTP_FLOAT_CLONED(template <class scalar_t>, T, pass_weight_sum,
                 (LogOdds<scalar_t, T> x, int64_t n, T delta, T l1, T l0), (x, n, delta, l1, l0))
DTP_FLOAT_CLONED(template <class scalar_t>, void, grad_scores,
                 (LogOdds<scalar_t, T> x, const T* g, int64_t n, T k, T gp, T scale,
                  const double* rows, const double* coef, int64_t npass, T* grad),
                 (x, g, n, k, gp, scale, rows, coef, npass, grad))

// ---- host side ----

struct Segments {
  int64_t nseg;
  int64_t numel;
  std::vector<int64_t> offsets;
  std::vector<double> keep;
  std::vector<double> eps;
  std::vector<Chunk> chunks;
};

// A small per-segment CPU tensor (float32 or float64, any stride) as doubles.
std::vector<double> to_doubles(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble),
              "dtp::transport_mask: ", name, " must be a 1-D float32 or float64 CPU tensor");
  std::vector<double> out(t.numel());
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "to_doubles", [&] {
    const auto a = t.accessor<scalar_t, 1>();
    for (int64_t i = 0; i < t.numel(); ++i) out[i] = static_cast<double>(a[i]);
  });
  return out;
}

// The segment layout and the host copies of keep and eps, with every value checked.
// The caller has run check_transport_args.
Segments read_segments(const at::Tensor& scores, const at::Tensor& offsets, const at::Tensor& keep,
                       const at::Tensor& eps) {
  Segments sg;
  sg.nseg = offsets.numel() - 1;
  sg.numel = scores.numel();
  auto off = offsets.to(at::kCPU).contiguous();
  sg.offsets.assign(off.data_ptr<int64_t>(), off.data_ptr<int64_t>() + off.numel());
  TORCH_CHECK(
      sg.offsets.front() == 0 && sg.offsets.back() == sg.numel,
      "dtp::transport_mask: offsets must start at 0 and end at scores.numel() = ", sg.numel);
  for (int64_t s = 0; s < sg.nseg; ++s) {
    TORCH_CHECK(sg.offsets[s + 1] > sg.offsets[s], "dtp::transport_mask: segment ", s,
                " is empty; every segment needs n >= 1");
  }
  sg.keep = to_doubles(keep, "keep");
  sg.eps = to_doubles(eps, "eps");
  for (int64_t s = 0; s < sg.nseg; ++s) {
    const int64_t n = sg.offsets[s + 1] - sg.offsets[s];
    TORCH_CHECK(sg.keep[s] >= 0.0 && sg.keep[s] <= static_cast<double>(n),
                "dtp::transport_mask: keep[", s, "] = ", sg.keep[s], " is outside [0, ", n, "]");
    TORCH_CHECK(sg.eps[s] > 0.0 && std::isfinite(sg.eps[s]), "dtp::transport_mask: eps[", s,
                "] = ", sg.eps[s], " must be finite and > 0");
  }
  sg.chunks = make_chunks(sg.offsets.data(), sg.nseg);
  return sg;
}

// A chunk's x_i = d_i + (2 s_i - 1) / eps, read from the start of the chunk.
template <class scalar_t, class acc_t>
LogOdds<scalar_t, acc_t> chunk_log_odds(const Segments& sg, const scalar_t* s, const acc_t* d,
                                        bool neutral, const Chunk& ch) {
  const acc_t inv_eps = static_cast<acc_t>(1.0 / sg.eps[ch.seg]);
  return LogOdds<scalar_t, acc_t>{s, d, inv_eps, neutral} + ch.begin;
}

double log_ratio(double k, int64_t n) { return std::log(k) - std::log(static_cast<double>(n) - k); }

template <class scalar_t, class acc_t>
void forward_impl(const Segments& sg, const at::Tensor& scores, const at::Tensor& log_odds,
                  const at::Tensor& shift, int64_t iters, bool neutral, at::Tensor& mask,
                  at::Tensor& new_d, at::Tensor& new_shift, at::Tensor& stats,
                  at::Tensor& nonfinite) {
  const int64_t nseg = sg.nseg, nch = static_cast<int64_t>(sg.chunks.size());
  const acc_t* d = log_odds.data_ptr<acc_t>();
  const acc_t* shift_in = shift.data_ptr<acc_t>();
  const scalar_t* s_p = scores.data_ptr<scalar_t>();
  auto x_of = [&](const Chunk& ch) { return chunk_log_odds(sg, s_p, d, neutral, ch); };
  std::vector<double> delta(nseg), l1(nseg), l0(nseg), bias(nseg);
  std::vector<uint8_t> degenerate(nseg);
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t n = sg.offsets[s + 1] - sg.offsets[s];
    delta[s] = static_cast<double>(shift_in[s]);
    degenerate[s] = is_degenerate(sg.keep[s], n);
    bias[s] = degenerate[s] ? 0.0 : log_ratio(sg.keep[s], n);
  }
  double* st = stats.data_ptr<double>();
  acc_t* mask_p = mask.data_ptr<acc_t>();
  // Column sums and their stabilisers (log of the scale the sums are taken at; 0: none).
  std::vector<double> m1(nseg, 0.0), m0(nseg, 0.0), s1(nseg, 0.0), s0(nseg, 0.0);
  std::vector<uint8_t> finite(nseg, 1), stabilise(nseg, 1);

  // One pass (the paper's step): the sums without a stabiliser, two passes over the data
  // in all; they stand for every segment whose largest terms allow it.
  if (iters == 1) {
    std::vector<FirstSums<acc_t>> first(nch);
    for_each_chunk(sg.chunks, sg.numel, [&](int64_t c, const Chunk& ch) {
      first[c] = first_sums(x_of(ch), ch.end - ch.begin, static_cast<acc_t>(delta[ch.seg]),
                            mask_p + ch.begin);
    });
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t s = sg.chunks[c].seg;
      s1[s] += first[c].s1;
      s0[s] += first[c].s0;
      finite[s] = finite[s] && first[c].finite;
    }
    for (int64_t s = 0; s < nseg; ++s) {
      const double least =
          static_cast<double>(sg.offsets[s + 1] - sg.offsets[s]) * std::exp(kMinScaledShift);
      stabilise[s] = !(finite[s] && s1[s] >= least && s0[s] >= least);
    }
  }

  // The other segments (all of them for iters > 1): the extremes of x give each column's
  // largest log-term (log sigmoid is monotone), by which every pass's sums are scaled.
  std::vector<Chunk> rest;
  for (const Chunk& ch : sg.chunks) {
    if (stabilise[ch.seg]) rest.push_back(ch);
  }
  const int64_t nrest = static_cast<int64_t>(rest.size());
  std::vector<double> xmin(nseg, INFINITY), xmax(nseg, -INFINITY);
  if (nrest > 0) {
    std::vector<Extremes<acc_t>> extremes(nrest);
    for_each_chunk(rest, sg.numel, [&](int64_t c, const Chunk& ch) {
      extremes[c] = log_odds_chunk(x_of(ch), ch.end - ch.begin);
    });
    for (int64_t c = 0; c < nrest; ++c) {
      const int64_t s = rest[c].seg;
      xmin[s] = std::min<double>(xmin[s], extremes[c].lo);
      xmax[s] = std::max<double>(xmax[s], extremes[c].hi);
      finite[s] = finite[s] && extremes[c].finite;
    }
  }
  std::vector<double> ps1(nrest), ps0(nrest);
  for (int64_t t = 0; t < iters; ++t) {
    if (nrest > 0) {
      for (int64_t s = 0; s < nseg; ++s) {
        if (!stabilise[s]) continue;
        m1[s] = log_sigmoid(xmax[s] + delta[s]);
        m0[s] = log_sigmoid(-(xmin[s] + delta[s]));
        if (!std::isfinite(m1[s])) m1[s] = 0.0;  // non-finite segment: its state is kept
        if (!std::isfinite(m0[s])) m0[s] = 0.0;
        s1[s] = s0[s] = 0.0;
      }
      acc_t* terms = t == iters - 1 ? mask_p : nullptr;  // the last pass keeps its terms
      for_each_chunk(rest, sg.numel, [&](int64_t c, const Chunk& ch) {
        const int64_t s = ch.seg;
        const auto sums = column_sums(x_of(ch), ch.end - ch.begin, static_cast<acc_t>(delta[s]),
                                      static_cast<acc_t>(m1[s]), static_cast<acc_t>(m0[s]),
                                      terms == nullptr ? nullptr : terms + ch.begin);
        ps1[c] = sums.s1;
        ps0[c] = sums.s0;
      });
      for (int64_t c = 0; c < nrest; ++c) {
        s1[rest[c].seg] += ps1[c];
        s0[rest[c].seg] += ps0[c];
      }
    }
    for (int64_t s = 0; s < nseg; ++s) {
      // The shift is rounded to acc_t exactly as the elementwise pass saw it.
      const double dl = static_cast<double>(static_cast<acc_t>(delta[s]));
      l1[s] = m1[s] + std::log(s1[s]);
      l0[s] = m0[s] + std::log(s0[s]);
      double* row = st + (s * iters + t) * 3;
      row[0] = dl;
      row[1] = l1[s];
      row[2] = l0[s];
      delta[s] = bias[s] + dl - l1[s] + l0[s];
    }
  }

  // Mask and next state. A degenerate or non-finite segment keeps its state.
  std::vector<uint8_t> advance(nseg);
  acc_t* new_shift_p = new_shift.data_ptr<acc_t>();
  bool* nonfinite_p = nonfinite.data_ptr<bool>();
  for (int64_t s = 0; s < nseg; ++s) {
    nonfinite_p[s] = !(finite[s] && std::isfinite(delta[s]));
    advance[s] = !degenerate[s] && !nonfinite_p[s];
    new_shift_p[s] = advance[s] ? static_cast<acc_t>(delta[s]) : shift_in[s];
  }
  acc_t* new_d_p = new_d.data_ptr<acc_t>();
  for_each_chunk(sg.chunks, sg.numel, [&](int64_t c, const Chunk& ch) {
    const int64_t s = ch.seg, len = ch.end - ch.begin;
    const int64_t n = sg.offsets[s + 1] - sg.offsets[s];
    if (degenerate[s]) {
      std::fill(mask_p + ch.begin, mask_p + ch.end, static_cast<acc_t>(sg.keep[s] / n));
    } else {  // mask_i = k P[i, 1] = k exp(log sigmoid(z_i) - L1) = k t_i / sum_j t_j
      mask_and_state(x_of(ch), len, static_cast<acc_t>(sg.keep[s] / s1[s]),
                     static_cast<acc_t>(delta[s]), mask_p + ch.begin, new_d_p + ch.begin);
    }
    if (!advance[s]) std::copy(d + ch.begin, d + ch.end, new_d_p + ch.begin);
  });
}

template <class scalar_t, class acc_t>
void backward_impl(const Segments& sg, const acc_t* g, const scalar_t* s_p, const acc_t* d,
                   const acc_t* mask, bool neutral, const double* st, int64_t iters, acc_t* grad_x,
                   double* grad_keep) {
  auto x_of = [&](const Chunk& ch) { return chunk_log_odds(sg, s_p, d, neutral, ch); };
  const int64_t nseg = sg.nseg, nch = static_cast<int64_t>(sg.chunks.size());
  auto seg_n = [&](int64_t s) { return sg.offsets[s + 1] - sg.offsets[s]; };
  auto row = [&](int64_t s, int64_t t) { return st + (s * iters + t) * 3; };

  // Last pass: mask = k p, dL/dz = k q (g - sum g p). grad_x holds q for now. For one
  // pass, given the forward's mask, p and q come from it; else from the scores and
  // log-odds. (With earlier passes the keep gradient carries sum g q - sum g p sum q
  // times n / (k (n - k)), which for k near 0 or n magnifies q's rounding.)
  if (iters > 1) mask = nullptr;
  std::vector<GradSums<double>> part(nch);
  for_each_chunk(sg.chunks, sg.numel, [&](int64_t c, const Chunk& ch) {
    const double* r = row(ch.seg, iters - 1);
    const int64_t len = ch.end - ch.begin;
    GradSums<acc_t> p;
    if (mask != nullptr) {
      const double k = sg.keep[ch.seg];
      const double inv_k = is_degenerate(k, seg_n(ch.seg)) ? 0.0 : 1.0 / k;
      p = grad_sums_from_mask(mask + ch.begin, g + ch.begin, len, static_cast<acc_t>(inv_k),
                              static_cast<acc_t>(std::exp(r[1])), grad_x + ch.begin);
    } else {
      p = grad_sums(x_of(ch), g + ch.begin, len, static_cast<acc_t>(r[0]), static_cast<acc_t>(r[1]),
                    grad_x + ch.begin);
    }
    part[c] = {p.gp, p.gq, p.q, p.g};
  });
  std::vector<GradSums<double>> sums(nseg, GradSums<double>{0, 0, 0, 0});
  for (int64_t c = 0; c < nch; ++c) {
    auto& a = sums[sg.chunks[c].seg];
    a.gp += part[c].gp;
    a.gq += part[c].gq;
    a.q += part[c].q;
    a.g += part[c].g;
  }

  // Earlier passes (iters > 1): delta_t = B + delta_{t-1} - L1 + L0 depends on x, with
  // d delta_t / d x_i = -w_i and d delta_t / d delta_{t-1} = 1 - W (W = sum_i w_i).
  const int64_t npass = iters - 1;
  std::vector<double> coef(nseg * std::max<int64_t>(npass, 1), 0.0), grad_bias(nseg, 0.0);
  if (npass > 0) {
    std::vector<double> wpart(nch * npass);
    for_each_chunk(sg.chunks, sg.numel, [&](int64_t c, const Chunk& ch) {
      for (int64_t t = 0; t < npass; ++t) {
        const double* r = row(ch.seg, t);
        wpart[c * npass + t] =
            pass_weight_sum(x_of(ch), ch.end - ch.begin, static_cast<acc_t>(r[0]),
                            static_cast<acc_t>(r[1]), static_cast<acc_t>(r[2]));
      }
    });
    std::vector<double> wsum(nseg * npass, 0.0);
    for (int64_t c = 0; c < nch; ++c) {
      for (int64_t t = 0; t < npass; ++t)
        wsum[sg.chunks[c].seg * npass + t] += wpart[c * npass + t];
    }
    for (int64_t s = 0; s < nseg; ++s) {
      const double k = sg.keep[s];
      double gdelta = k * (sums[s].gq - sums[s].gp * sums[s].q);  // sum_i dL/dz_i
      for (int64_t t = npass; t >= 1; --t) {
        coef[s * npass + t - 1] = -gdelta;
        grad_bias[s] += gdelta;
        gdelta *= 1.0 - wsum[s * npass + t - 1];
      }
    }
  }

  for_each_chunk(sg.chunks, sg.numel, [&](int64_t c, const Chunk& ch) {
    const int64_t s = ch.seg;
    if (is_degenerate(sg.keep[s], seg_n(s))) {
      std::fill(grad_x + ch.begin, grad_x + ch.end, acc_t(0));
      return;
    }
    grad_scores(x_of(ch), g + ch.begin, ch.end - ch.begin, static_cast<acc_t>(sg.keep[s]),
                static_cast<acc_t>(sums[s].gp), static_cast<acc_t>(2.0 / sg.eps[s]), row(s, 0),
                coef.data() + s * npass, npass, grad_x + ch.begin);
  });

  for (int64_t s = 0; s < nseg; ++s) {
    const double k = sg.keep[s];
    const int64_t n = seg_n(s);
    if (is_degenerate(k, n)) {
      grad_keep[s] = sums[s].g / static_cast<double>(n);  // mask = k / n everywhere
    } else {
      grad_keep[s] = sums[s].gp + grad_bias[s] * n / (k * (static_cast<double>(n) - k));
    }
  }
}

// The forward's mask, contiguous, when the backward can form p and q from it: given and
// in the compute dtype (a float16 or bfloat16 mask is too coarse for them); else
// undefined, and they are recomputed from the scores and log-odds.
at::Tensor usable_mask(const std::optional<at::Tensor>& mask, const at::Tensor& scores) {
  if (!mask.has_value() || !mask->defined()) return at::Tensor();
  TORCH_CHECK(mask->numel() == scores.numel(), "dtp::transport_mask_backward: mask has ",
              mask->numel(), " elements, expected ", scores.numel());
  TORCH_CHECK(mask->device() == scores.device(), "dtp::transport_mask_backward: mask is on ",
              mask->device(), ", the scores on ", scores.device());
  return mask->scalar_type() == acc_type(scores) ? mask->contiguous() : at::Tensor();
}

void check_shift(const at::Tensor& scores, const at::Tensor& shift, int64_t nseg) {
  TORCH_CHECK(shift.scalar_type() == acc_type(scores) && shift.numel() == nseg,
              "dtp::transport_mask: shift must be ", acc_type(scores),
              " with one entry per segment (", nseg, ")");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_cpu(
    const at::Tensor& scores_in, const at::Tensor& offsets, const at::Tensor& keep,
    const at::Tensor& eps, const at::Tensor& log_odds_in, const at::Tensor& shift_in, int64_t iters,
    bool neutral_nonfinite, int64_t blocks_per_segment, int64_t segment_size) {
  // blocks_per_segment > 0 picks the general kernels (on CUDA also their schedule); the
  // CPU chunking does not depend on its value.
  check_blocks_per_segment(blocks_per_segment);
  TORCH_CHECK(iters >= 1, "dtp::transport_mask: iters must be >= 1, got ", iters);
  check_transport_args(scores_in, offsets, keep, eps, log_odds_in);
  check_segment_size(segment_size, scores_in, offsets);
  if (use_blocks_kernels(segment_size, blocks_per_segment)) {
    check_shift(scores_in, shift_in, offsets.numel() - 1);
    return transport_mask_blocks_cpu(scores_in, keep, eps, log_odds_in, shift_in, iters,
                                     neutral_nonfinite, segment_size);
  }
  const Segments sg = read_segments(scores_in, offsets, keep, eps);
  check_shift(scores_in, shift_in, sg.nseg);
  const auto scores = scores_in.contiguous();
  const auto log_odds = log_odds_in.contiguous();
  const auto shift = shift_in.contiguous();
  const auto acc = acc_type(scores);
  auto mask_acc = empty_output({sg.numel}, log_odds.options());
  auto stats = at::empty({sg.nseg, iters, 3}, log_odds.options().dtype(at::kDouble));
  // Every check is above: what follows cannot fail half-way through a lent buffer.
  auto [new_d, new_shift, nonfinite] = take_state_outputs(scores, log_odds, shift);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, scores.scalar_type(), "transport_mask_cpu", [&] {
        if (acc == at::kDouble) {
          forward_impl<scalar_t, double>(sg, scores, log_odds, shift, iters, neutral_nonfinite,
                                         mask_acc, new_d, new_shift, stats, nonfinite);
        } else {
          forward_impl<scalar_t, float>(sg, scores, log_odds, shift, iters, neutral_nonfinite,
                                        mask_acc, new_d, new_shift, stats, nonfinite);
        }
      });
  auto mask =
      mask_acc.scalar_type() == scores.scalar_type() ? mask_acc : mask_acc.to(scores.scalar_type());
  return {mask, new_d, new_shift, stats, nonfinite};
}

std::tuple<at::Tensor, at::Tensor> transport_mask_backward_cpu(
    const at::Tensor& grad_mask, const at::Tensor& scores_in, const at::Tensor& offsets,
    const at::Tensor& keep, const at::Tensor& eps, const at::Tensor& log_odds_in,
    const at::Tensor& stats_in, bool neutral_nonfinite, int64_t blocks_per_segment,
    int64_t segment_size, const std::optional<at::Tensor>& mask_in) {
  check_blocks_per_segment(blocks_per_segment);
  check_transport_args(scores_in, offsets, keep, eps, log_odds_in);
  check_segment_size(segment_size, scores_in, offsets);
  const at::Tensor mask = usable_mask(mask_in, scores_in);
  const bool blocks_kernels = use_blocks_kernels(segment_size, blocks_per_segment);
  check_stats(stats_in, scores_in, offsets.numel() - 1, blocks_kernels);
  if (blocks_kernels) {
    TORCH_CHECK(grad_mask.numel() == scores_in.numel(),
                "dtp::transport_mask_backward: grad_mask has ", grad_mask.numel(),
                " elements, expected ", scores_in.numel());
    // The tiny-segment kernels recompute p and q: from the mask their tiles were slower
    // (2:4, 1M weights, 1 thread: 0.93x).
    return transport_mask_blocks_backward_cpu(grad_mask, scores_in, keep, eps, log_odds_in,
                                              stats_in, neutral_nonfinite, segment_size);
  }
  const Segments sg = read_segments(scores_in, offsets, keep, eps);
  TORCH_CHECK(grad_mask.numel() == sg.numel, "dtp::transport_mask_backward: grad_mask has ",
              grad_mask.numel(), " elements, expected ", sg.numel);
  const int64_t iters = stats_in.size(1);
  const auto scores = scores_in.contiguous();
  const auto log_odds = log_odds_in.contiguous();
  const auto stats = stats_in.contiguous();
  const auto acc = acc_type(scores);
  const auto g = grad_mask.to(acc).contiguous();
  auto grad_x = empty_output({sg.numel}, log_odds.options());
  std::vector<double> grad_keep(sg.nseg);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, scores.scalar_type(), "transport_mask_backward_cpu", [&] {
        if (acc == at::kDouble) {
          backward_impl<scalar_t, double>(
              sg, g.data_ptr<double>(), scores.data_ptr<scalar_t>(), log_odds.data_ptr<double>(),
              mask.defined() ? mask.data_ptr<double>() : nullptr, neutral_nonfinite,
              stats.data_ptr<double>(), iters, grad_x.data_ptr<double>(), grad_keep.data());
        } else {
          backward_impl<scalar_t, float>(
              sg, g.data_ptr<float>(), scores.data_ptr<scalar_t>(), log_odds.data_ptr<float>(),
              mask.defined() ? mask.data_ptr<float>() : nullptr, neutral_nonfinite,
              stats.data_ptr<double>(), iters, grad_x.data_ptr<float>(), grad_keep.data());
        }
      });
  auto grad_keep_t = at::empty({sg.nseg}, keep.options());
  AT_DISPATCH_FLOATING_TYPES(keep.scalar_type(), "grad_keep", [&] {
    auto out = grad_keep_t.accessor<scalar_t, 1>();
    for (int64_t s = 0; s < sg.nseg; ++s) out[s] = static_cast<scalar_t>(grad_keep[s]);
  });
  return {grad_x.to(scores.scalar_type()), grad_keep_t};
}

TORCH_LIBRARY_IMPL(dtp, CPU, m) {
  m.impl("transport_mask", &transport_mask_cpu);
  m.impl("transport_mask_backward", &transport_mask_backward_cpu);
}

}  // namespace dtp
