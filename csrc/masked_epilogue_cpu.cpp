// C++ CPU kernels of the masked-channel epilogue, out = act((y + bias[c]) * mask[c]).
//
// Memory is viewed as [outer][C][inner]: NCHW-contiguous has inner = H*W ("planes"), a
// channels-last or (N, C) tensor has inner = 1 ("rows"). The forward is one pass over y.
// The backward is one pass producing dy and per-channel partial sums in fixed blocks,
// which a second, sequential stage adds up in block order: deterministic for any
// number of threads.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "common.h"
#include "cpu_outputs.h"

namespace dtp {
namespace {

constexpr int64_t kGrainElements = 32768;  // elements per parallel task, at least
constexpr int64_t kRowBlock = 64;          // rows per partial-sum block (channels-last)

using Layout = EpilogueLayout;

// A per-channel vector (mask or bias) in acc_t, on the CPU.
template <class acc_t>
at::Tensor channel_values(const at::Tensor& t, int64_t channels, const char* name) {
  return channel_vector(t, channels, c10::CppTypeToScalarType<acc_t>::value, name).cpu();
}

// ---- loops ----

template <bool kRelu, class scalar_t, class acc_t>
DTP_INLINE void forward_plane(const scalar_t* y, int64_t n, acc_t b, acc_t m, scalar_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    acc_t v = (static_cast<acc_t>(y[i]) + b) * m;
    if constexpr (kRelu) v = v > acc_t(0) ? v : acc_t(0);
    out[i] = static_cast<scalar_t>(v);
  }
}

template <bool kRelu, class scalar_t, class acc_t>
DTP_INLINE void forward_row(const scalar_t* y, int64_t n, const acc_t* b, const acc_t* m,
                            scalar_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    acc_t v = (static_cast<acc_t>(y[i]) + b[i]) * m[i];
    if constexpr (kRelu) v = v > acc_t(0) ? v : acc_t(0);
    out[i] = static_cast<scalar_t>(v);
  }
}

// dy = g m with g = dout (masked by the ReLU); returns sum g (y + b) and sum g.
template <bool kRelu, class scalar_t, class acc_t>
DTP_INLINE std::pair<acc_t, acc_t> backward_plane(const scalar_t* go, const scalar_t* y, int64_t n,
                                                  acc_t b, acc_t m, scalar_t* dy) {
  constexpr int64_t kLanes = 16;
  acc_t sgy[kLanes] = {}, sg[kLanes] = {};
  for (int64_t base = 0; base < n; base += kLanes) {
    const int64_t len = std::min(kLanes, n - base);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = base + j;
      const acc_t yb = static_cast<acc_t>(y[i]) + b;
      acc_t g = static_cast<acc_t>(go[i]);
      if constexpr (kRelu) g = yb * m > acc_t(0) ? g : acc_t(0);
      dy[i] = static_cast<scalar_t>(g * m);
      sgy[j] += g * yb;
      sg[j] += g;
    }
  }
  acc_t a = 0, c = 0;
  for (int64_t j = 0; j < kLanes; ++j) {
    a += sgy[j];
    c += sg[j];
  }
  return {a, c};
}

template <bool kRelu, class scalar_t, class acc_t>
DTP_INLINE void backward_row(const scalar_t* go, const scalar_t* y, int64_t n, const acc_t* b,
                             const acc_t* m, scalar_t* dy, acc_t* sgy, acc_t* sg) {
  for (int64_t i = 0; i < n; ++i) {
    const acc_t yb = static_cast<acc_t>(y[i]) + b[i];
    acc_t g = static_cast<acc_t>(go[i]);
    if constexpr (kRelu) g = yb * m[i] > acc_t(0) ? g : acc_t(0);
    dy[i] = static_cast<scalar_t>(g * m[i]);
    sgy[i] += g * yb;
    sg[i] += g;
  }
}

// Entry points with vector-ISA clones (the loops above inline into each clone).
template <bool kRelu, class scalar_t, class acc_t>
DTP_CLONES void forward_plane_k(const scalar_t* y, int64_t n, acc_t b, acc_t m, scalar_t* out) {
  forward_plane<kRelu>(y, n, b, m, out);
}
template <bool kRelu, class scalar_t, class acc_t>
DTP_CLONES void forward_row_k(const scalar_t* y, int64_t n, const acc_t* b, const acc_t* m,
                              scalar_t* out) {
  forward_row<kRelu>(y, n, b, m, out);
}
template <bool kRelu, class scalar_t, class acc_t>
DTP_CLONES std::pair<acc_t, acc_t> backward_plane_k(const scalar_t* go, const scalar_t* y,
                                                    int64_t n, acc_t b, acc_t m, scalar_t* dy) {
  return backward_plane<kRelu>(go, y, n, b, m, dy);
}
template <bool kRelu, class scalar_t, class acc_t>
DTP_CLONES void backward_row_k(const scalar_t* go, const scalar_t* y, int64_t n, const acc_t* b,
                               const acc_t* m, scalar_t* dy, acc_t* sgy, acc_t* sg) {
  backward_row<kRelu>(go, y, n, b, m, dy, sgy, sg);
}

// ---- host side ----

template <bool kRelu, class scalar_t, class acc_t>
void forward_impl(const at::Tensor& y, const Layout& L, const acc_t* m, const acc_t* b,
                  at::Tensor& out) {
  const scalar_t* yp = y.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  if (L.inner > 1) {
    const int64_t planes = L.outer * L.channels;
    const int64_t grain = std::max<int64_t>(1, kGrainElements / L.inner);
    at::parallel_for(0, planes, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t c = p % L.channels;
        forward_plane_k<kRelu>(yp + p * L.inner, L.inner, b[c], m[c], op + p * L.inner);
      }
    });
  } else {
    const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(L.channels, 1));
    at::parallel_for(0, L.outer, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        forward_row_k<kRelu>(yp + r * L.channels, L.channels, b, m, op + r * L.channels);
      }
    });
  }
}

template <bool kRelu, class scalar_t, class acc_t>
void backward_impl(const at::Tensor& go, const at::Tensor& y, const Layout& L, const acc_t* m,
                   const acc_t* b, at::Tensor& dy, std::vector<double>& sum_gy,
                   std::vector<double>& sum_g) {
  const scalar_t* gp = go.data_ptr<scalar_t>();
  const scalar_t* yp = y.data_ptr<scalar_t>();
  scalar_t* dp = dy.data_ptr<scalar_t>();
  const int64_t C = L.channels;
  if (L.inner > 1) {
    // Stage 1: one partial per (outer, channel) plane. Stage 2: add over outer in order.
    const int64_t planes = L.outer * C;
    std::vector<acc_t> pgy(planes), pg(planes);
    const int64_t grain = std::max<int64_t>(1, kGrainElements / L.inner);
    at::parallel_for(0, planes, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t c = p % C, off = p * L.inner;
        const auto s = backward_plane_k<kRelu>(gp + off, yp + off, L.inner, b[c], m[c], dp + off);
        pgy[p] = s.first;
        pg[p] = s.second;
      }
    });
    for (int64_t o = 0; o < L.outer; ++o) {
      for (int64_t c = 0; c < C; ++c) {
        sum_gy[c] += pgy[o * C + c];
        sum_g[c] += pg[o * C + c];
      }
    }
  } else {
    // Stage 1: per block of kRowBlock rows, C partial sums. Stage 2: add blocks in order.
    const int64_t blocks = (L.outer + kRowBlock - 1) / kRowBlock;
    std::vector<acc_t> pgy(blocks * C, acc_t(0)), pg(blocks * C, acc_t(0));
    const int64_t grain =
        std::max<int64_t>(1, kGrainElements / std::max<int64_t>(kRowBlock * C, 1));
    at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        const int64_t end = std::min(L.outer, (k + 1) * kRowBlock);
        for (int64_t r = k * kRowBlock; r < end; ++r) {
          backward_row_k<kRelu>(gp + r * C, yp + r * C, C, b, m, dp + r * C, pgy.data() + k * C,
                                pg.data() + k * C);
        }
      }
    });
    for (int64_t k = 0; k < blocks; ++k) {
      for (int64_t c = 0; c < C; ++c) {
        sum_gy[c] += pgy[k * C + c];
        sum_g[c] += pg[k * C + c];
      }
    }
  }
}

void check_inputs(const at::Tensor& y, const at::Tensor& mask,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(y.is_floating_point(), "dtp::masked_channel_epilogue: y must be floating point, got ",
              y.scalar_type());
  TORCH_CHECK(mask.device() == y.device() && (!bias || bias->device() == y.device()),
              "dtp::masked_channel_epilogue: y, mask and bias must be on one device");
}

}  // namespace

at::Tensor masked_channel_epilogue_cpu(const at::Tensor& y_in, const at::Tensor& mask,
                                       const c10::optional<at::Tensor>& bias,
                                       c10::string_view activation, int64_t channel_dim) {
  check_inputs(y_in, mask, bias);
  const bool relu = parse_activation(activation);
  const Layout L = epilogue_layout(y_in, channel_dim);
  const at::Tensor& y = L.y;
  auto out = empty_output_like(y);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "epilogue_fwd", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const auto m_t = channel_values<acc_t>(mask, L.channels, "mask");
    const auto b_t = bias ? channel_values<acc_t>(*bias, L.channels, "bias") : at::zeros_like(m_t);
    const acc_t* m = m_t.template data_ptr<acc_t>();
    const acc_t* b = b_t.template data_ptr<acc_t>();
    if (relu) {
      forward_impl<true, scalar_t, acc_t>(y, L, m, b, out);
    } else {
      forward_impl<false, scalar_t, acc_t>(y, L, m, b, out);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_channel_epilogue_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& y_in, const at::Tensor& mask,
    const c10::optional<at::Tensor>& bias, c10::string_view activation, int64_t channel_dim) {
  check_inputs(y_in, mask, bias);
  TORCH_CHECK(grad_out.sizes() == y_in.sizes(),
              "dtp::masked_channel_epilogue_backward: grad_out has shape ", grad_out.sizes(),
              ", y has ", y_in.sizes());
  const bool relu = parse_activation(activation);
  const Layout L = epilogue_layout(y_in, channel_dim);
  const at::Tensor& y = L.y;
  // grad_out in exactly y's layout and dtype.
  at::Tensor go = grad_out;
  if (go.strides() != y.strides() || go.scalar_type() != y.scalar_type()) {
    go = at::empty_like(y).copy_(grad_out);
  }
  auto dy = empty_output_like(y);
  std::vector<double> sum_gy(L.channels, 0.0), sum_g(L.channels, 0.0);
  std::vector<double> mask_d(L.channels);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "epilogue_bwd", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const auto m_t = channel_values<acc_t>(mask, L.channels, "mask");
    const auto b_t = bias ? channel_values<acc_t>(*bias, L.channels, "bias") : at::zeros_like(m_t);
    const acc_t* m = m_t.template data_ptr<acc_t>();
    const acc_t* b = b_t.template data_ptr<acc_t>();
    for (int64_t c = 0; c < L.channels; ++c) mask_d[c] = static_cast<double>(m[c]);
    if (relu) {
      backward_impl<true, scalar_t, acc_t>(go, y, L, m, b, dy, sum_gy, sum_g);
    } else {
      backward_impl<false, scalar_t, acc_t>(go, y, L, m, b, dy, sum_gy, sum_g);
    }
  });
  // d mask[c] = sum g (y + b); d bias[c] = mask[c] sum g.
  auto grad_mask_d = at::empty({L.channels}, mask.options().dtype(at::kDouble));
  auto grad_bias_d = at::empty({L.channels}, mask.options().dtype(at::kDouble));
  double* gm = grad_mask_d.data_ptr<double>();
  double* gb = grad_bias_d.data_ptr<double>();
  for (int64_t c = 0; c < L.channels; ++c) {
    gm[c] = sum_gy[c];
    gb[c] = mask_d[c] * sum_g[c];
  }
  auto grad_mask = grad_mask_d.to(mask.scalar_type());
  auto grad_bias = grad_bias_d.to(bias ? bias->scalar_type() : mask.scalar_type());
  return {dy, grad_mask, grad_bias};
}

TORCH_LIBRARY_IMPL(dtp, CPU, m) {
  m.impl("masked_channel_epilogue", &masked_channel_epilogue_cpu);
  m.impl("masked_channel_epilogue_backward", &masked_channel_epilogue_backward_cpu);
}

}  // namespace dtp
