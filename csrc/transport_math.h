// Per-element math of the DTP transport-mask step, shared by the C++ CPU kernels and
// the CUDA kernels. Everything here is inline and free of ATen so both compilers see
// the same formulas (docs/design.md section 1).
//
// Notation: z = x + delta is the log-odds of the Gibbs kernel's two columns, and
//   log sigmoid(z)  = min(z, 0)  + log r,   r = 1 / (1 + exp(-|z|)),
//   log sigmoid(-z) = min(-z, 0) + log r.
// Writing the log-sigmoids this way needs one exp and one division per element and
// never evaluates log1p, so the loops vectorise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Internal linkage: each kernel file gets its own copies, called directly (no PLT).
#if defined(__CUDACC__)
#define DTP_HOST_DEVICE __host__ __device__ static
#else
// always_inline: an out-of-line call would stop the loops that use these from vectorising.
#define DTP_HOST_DEVICE static __attribute__((always_inline))
#endif

namespace dtp {

// exp for float: range reduction to |r| <= ln2/2 and a degree-7 Taylor polynomial
// (error below 1 ulp on that range). Written without library calls so the compiler
// vectorises the loops that use it. NaN propagates; x < -87 gives 0, x > 88.72 gives inf.
constexpr float kExpLow = -87.0f;
constexpr float kExpHigh = 88.72283935546875f;

// exp(xc) for xc in [kExpLow, kExpHigh] or NaN (NaN in, NaN out).
DTP_HOST_DEVICE inline float exp_in_range(float xc) {
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693145751953125f;  // ln2 split in a high part ...
  r = r - n * 1.42860682030941723e-06f;   // ... and a low part
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^(n-1) built from its exponent bits, times 2: n - 1 stays in [-126, 127].
  const float n_safe = (n == n) ? n : 0.0f;
  const int32_t bits = (static_cast<int32_t>(n_safe) + 126) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale * 2.0f;
}

DTP_HOST_DEVICE inline float exp_fast(float x) {
#if defined(__CUDA_ARCH__)
  return ::expf(x);
#else
  float xc = x < kExpLow ? kExpLow : x;  // NaN stays NaN: comparisons with NaN are false
  xc = xc > kExpHigh ? kExpHigh : xc;
  float y = exp_in_range(xc);
  y = x < kExpLow ? 0.0f : y;
  y = x > kExpHigh ? INFINITY : y;
  return y;
#endif
}

// exp_fast for x <= 0 or NaN (the sigmoids' exp(-|z|)): the same values, without the
// overflow clamp and select, which cannot apply.
DTP_HOST_DEVICE inline float exp_nonpositive(float x) {
#if defined(__CUDA_ARCH__)
  return ::expf(x);
#else
  const float y = exp_in_range(x < kExpLow ? kExpLow : x);
  return x < kExpLow ? 0.0f : y;
#endif
}

DTP_HOST_DEVICE inline double exp_fast(double x) { return ::exp(x); }
DTP_HOST_DEVICE inline double exp_nonpositive(double x) { return ::exp(x); }

// log for float, written without library calls so loops that use it vectorise: x = 2^e m
// with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172,
// as an odd series to s^9 (error below 1e-9 relative). Subnormals are scaled first;
// log 0 = -inf, log inf = inf, negative or NaN x gives NaN.

// log(x / 2^shift) for x a positive, finite, normal float (shift applied to the
// exponent, as an integer).
DTP_HOST_DEVICE inline float log_normal(float x, int32_t shift) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  int32_t e = ((bits >> 23) & 0xff) - 127 - shift;
  int32_t mbits = (bits & 0x7fffff) | 0x3f800000;
  float m;
  std::memcpy(&m, &mbits, sizeof(m));
  const bool high = m > 1.41421356f;
  m = high ? m * 0.5f : m;
  e += high ? 1 : 0;
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  float p = 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  const float ef = static_cast<float>(e);
  return ef * 0.693145751953125f + (2.0f * s * p + ef * 1.42860682030941723e-06f);
}

DTP_HOST_DEVICE inline float log_fast(float x) {
#if defined(__CUDA_ARCH__)
  return ::logf(x);
#else
  const bool tiny = x < 1.17549435e-38f;  // below the smallest normal (also 0, < 0, NaN no)
  float y = log_normal(tiny ? x * 8388608.0f : x, tiny ? 23 : 0);  // 2^23
  y = x == 0.0f ? -INFINITY : y;
  y = x == INFINITY ? INFINITY : y;
  y = (x < 0.0f || x != x) ? NAN : y;
  return y;
#endif
}

// log_fast for x known to be positive, finite and normal (a column sum the caller has
// checked): the same formula without the special cases. Its result can differ from
// log_fast's by one unit in the last place: the compiler fuses the multiply-adds of the
// two differently.
DTP_HOST_DEVICE inline float log_of_normal(float x) {
#if defined(__CUDA_ARCH__)
  return ::logf(x);
#else
  return log_normal(x, 0);
#endif
}

DTP_HOST_DEVICE inline double log_fast(double x) { return ::log(x); }
DTP_HOST_DEVICE inline double log_of_normal(double x) { return ::log(x); }

// min(v, 0) that propagates NaN (std::fmin would drop it).
template <class T>
DTP_HOST_DEVICE inline T min_zero(T v) {
  return v > T(0) ? T(0) : v;
}

// r = sigmoid(|z|) = 1 / (1 + exp(-|z|)).
template <class T>
DTP_HOST_DEVICE inline T sigmoid_abs(T z) {
  return T(1) / (T(1) + exp_nonpositive(-(z < T(0) ? -z : z)));
}

// exp(log sigmoid(z) - shift), with r = sigmoid_abs(z).
template <class T>
DTP_HOST_DEVICE inline T exp_log_sigmoid(T z, T shift, T r) {
  return exp_fast(min_zero(z) - shift) * r;
}

// exp(log sigmoid(z) + log sigmoid(-z) - shift) = sigmoid(z) sigmoid(-z) / exp(shift).
template <class T>
DTP_HOST_DEVICE inline T exp_log_sigmoid_pair(T z, T shift, T r) {
  return exp_fast(-(z < T(0) ? -z : z) - shift) * r * r;
}

// The same three quantities with one exp per element: e = exp(-|z|) = exp(min(z, 0)) is
// reused, and exp(-shift) is one number per segment. Exact while exp(-shift) is finite and
// e * exp(-shift) does not lose terms that matter, which holds for shift >= kMinScaledShift
// (terms that then underflow are below e^-27 of the largest one).
constexpr double kMinScaledShift = -60.0;

// e = exp(-|z|) and r = 1 / (1 + e).
template <class T>
struct SigmoidParts {
  T e, r;
};
template <class T>
DTP_HOST_DEVICE inline SigmoidParts<T> sigmoid_parts(T z) {
  const T e = exp_nonpositive(-(z < T(0) ? -z : z));
  return {e, T(1) / (T(1) + e)};
}
// exp(log sigmoid(z)) * scale
template <class T>
DTP_HOST_DEVICE inline T scaled_sigmoid(T z, SigmoidParts<T> p, T scale) {
  return (z > T(0) ? scale : p.e * scale) * p.r;  // NaN z takes the e branch: NaN
}
// exp(log sigmoid(-z)) * scale
template <class T>
DTP_HOST_DEVICE inline T scaled_sigmoid_neg(T z, SigmoidParts<T> p, T scale) {
  return (z < T(0) ? scale : p.e * scale) * p.r;
}
// sigmoid(z) sigmoid(-z) * scale
template <class T>
DTP_HOST_DEVICE inline T scaled_sigmoid_pair(SigmoidParts<T> p, T scale) {
  return p.e * scale * p.r * p.r;
}

// log sigmoid(v) for one number per segment (double precision, library calls).
DTP_HOST_DEVICE inline double log_sigmoid(double v) {
  return (v > 0.0 ? 0.0 : v) - ::log1p(::exp(-(v < 0.0 ? -v : v)));
}

// A segment whose kept count is 0 or n has one feasible plan, P = a b^T: its mask is
// the constant k / n and its state does not move.
DTP_HOST_DEVICE inline bool is_degenerate(double k, int64_t n) {
  return !(k > 0.0 && k < static_cast<double>(n));
}

}  // namespace dtp
