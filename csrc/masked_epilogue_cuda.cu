// CUDA kernels of the masked-channel epilogue, out = act((y + bias[c]) * mask[c]).
// Memory is [outer][C][inner] as in masked_epilogue_cpu.cpp. The backward writes dy and
// per-channel partial sums (one per plane, or per block of rows) with block reductions,
// then one thread per channel adds its partials in order: deterministic, no atomics.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <string>

#include "block_sums.cuh"

namespace dtp {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRowBlock = 32;

template <bool kRelu, class scalar_t, class acc_t>
__global__ void epilogue_fwd_kernel(const scalar_t* __restrict__ y, const acc_t* __restrict__ mask,
                                    const acc_t* __restrict__ bias, int64_t numel, int64_t channels,
                                    int64_t inner, scalar_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = (i / inner) % channels;
    acc_t v = (static_cast<acc_t>(y[i]) + bias[c]) * mask[c];
    if constexpr (kRelu) v = v > acc_t(0) ? v : acc_t(0);
    out[i] = static_cast<scalar_t>(v);
  }
}

// One block per (outer, channel) plane of `inner` elements.
template <bool kRelu, class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    epilogue_bwd_planes_kernel(const scalar_t* __restrict__ go, const scalar_t* __restrict__ y,
                               const acc_t* __restrict__ mask, const acc_t* __restrict__ bias,
                               int64_t channels, int64_t inner, scalar_t* __restrict__ dy,
                               acc_t* __restrict__ part_gy, acc_t* __restrict__ part_g) {
  using Reduce = cub::BlockReduce<Pair<acc_t>, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t plane = blockIdx.x, c = plane % channels;
  const acc_t m = mask[c], b = bias[c];
  Pair<acc_t> local{0, 0};
  for (int64_t j = threadIdx.x; j < inner; j += kThreads) {
    const int64_t i = plane * inner + j;
    const acc_t yb = static_cast<acc_t>(y[i]) + b;
    acc_t g = static_cast<acc_t>(go[i]);
    if constexpr (kRelu) g = yb * m > acc_t(0) ? g : acc_t(0);
    dy[i] = static_cast<scalar_t>(g * m);
    local.a += g * yb;
    local.b += g;
  }
  const Pair<acc_t> total = Reduce(temp).Sum(local);
  if (threadIdx.x == 0) {
    part_gy[plane] = total.a;
    part_g[plane] = total.b;
  }
}

// Channels-last: block k takes rows [k * kRowBlock, ...), each thread a set of channels.
template <bool kRelu, class scalar_t, class acc_t>
__global__ void epilogue_bwd_rows_kernel(const scalar_t* __restrict__ go,
                                         const scalar_t* __restrict__ y,
                                         const acc_t* __restrict__ mask,
                                         const acc_t* __restrict__ bias, int64_t rows,
                                         int64_t channels, scalar_t* __restrict__ dy,
                                         acc_t* __restrict__ part_gy, acc_t* __restrict__ part_g) {
  const int64_t block = blockIdx.x;
  const int64_t end = min(rows, (block + 1) * kRowBlock);
  for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) {
    const acc_t m = mask[c], b = bias[c];
    acc_t sgy = 0, sg = 0;
    for (int64_t r = block * kRowBlock; r < end; ++r) {
      const int64_t i = r * channels + c;
      const acc_t yb = static_cast<acc_t>(y[i]) + b;
      acc_t g = static_cast<acc_t>(go[i]);
      if constexpr (kRelu) g = yb * m > acc_t(0) ? g : acc_t(0);
      dy[i] = static_cast<scalar_t>(g * m);
      sgy += g * yb;
      sg += g;
    }
    part_gy[block * channels + c] = sgy;
    part_g[block * channels + c] = sg;
  }
}

template <class acc_t>
__global__ void sum_partials_kernel(const acc_t* __restrict__ part_gy,
                                    const acc_t* __restrict__ part_g,
                                    const acc_t* __restrict__ mask, int64_t parts, int64_t channels,
                                    double* __restrict__ grad_mask,
                                    double* __restrict__ grad_bias) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= channels) return;
  double sgy = 0, sg = 0;
  for (int64_t p = 0; p < parts; ++p) {  // fixed order
    sgy += part_gy[p * channels + c];
    sg += part_g[p * channels + c];
  }
  grad_mask[c] = sgy;
  grad_bias[c] = static_cast<double>(mask[c]) * sg;
}

struct Layout {
  at::Tensor y;
  int64_t outer, channels, inner;
};

Layout kernel_layout(const at::Tensor& y, int64_t channel_dim) {
  TORCH_CHECK(y.dim() >= 2, "dtp::masked_channel_epilogue: y must have at least 2 dims");
  const int64_t cd = channel_dim < 0 ? channel_dim + y.dim() : channel_dim;
  TORCH_CHECK(cd >= 0 && cd < y.dim(), "dtp::masked_channel_epilogue: channel_dim ", channel_dim,
              " is out of range for a ", y.dim(), "-D tensor");
  const int64_t channels = y.size(cd);
  if (cd == 1 && !y.is_contiguous() &&
      ((y.dim() == 4 && y.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
       (y.dim() == 5 && y.is_contiguous(at::MemoryFormat::ChannelsLast3d)))) {
    return {y, channels == 0 ? 0 : y.numel() / channels, channels, 1};
  }
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < cd; ++d) outer *= y.size(d);
  for (int64_t d = cd + 1; d < y.dim(); ++d) inner *= y.size(d);
  return {y.contiguous(), outer, channels, inner};
}

at::Tensor channel_vector(const at::Tensor& t, int64_t channels, at::ScalarType acc,
                          const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == channels && t.is_floating_point(),
              "dtp::masked_channel_epilogue: ", name, " must be a 1-D floating tensor of ",
              channels, " channels, got shape ", t.sizes());
  return t.to(acc).contiguous();
}

bool parse_activation(c10::string_view activation) {
  TORCH_CHECK(activation == "none" || activation == "relu",
              "dtp::masked_channel_epilogue: activation must be 'none' or 'relu', got '",
              std::string(activation), "'");
  return activation == "relu";
}

}  // namespace

at::Tensor masked_channel_epilogue_cuda(const at::Tensor& y_in, const at::Tensor& mask,
                                        const c10::optional<at::Tensor>& bias,
                                        c10::string_view activation, int64_t channel_dim) {
  const bool relu = parse_activation(activation);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const Layout L = kernel_layout(y_in, channel_dim);
  const auto acc = L.y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto m = channel_vector(mask, L.channels, acc, "mask");
  const auto b = bias ? channel_vector(*bias, L.channels, acc, "bias") : at::zeros_like(m);
  auto out = at::empty_like(L.y);
  const int64_t numel = L.y.numel();
  if (numel == 0) return out;
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65536);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, L.y.scalar_type(), "epilogue_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        auto launch = [&](auto kernel) {
          kernel<<<blocks, kThreads, 0, stream>>>(L.y.data_ptr<scalar_t>(), m.data_ptr<acc_t>(),
                                                  b.data_ptr<acc_t>(), numel, L.channels, L.inner,
                                                  out.data_ptr<scalar_t>());
        };
        relu ? launch(epilogue_fwd_kernel<true, scalar_t, acc_t>)
             : launch(epilogue_fwd_kernel<false, scalar_t, acc_t>);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_channel_epilogue_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& y_in, const at::Tensor& mask,
    const c10::optional<at::Tensor>& bias, c10::string_view activation, int64_t channel_dim) {
  TORCH_CHECK(grad_out.sizes() == y_in.sizes(),
              "dtp::masked_channel_epilogue_backward: grad_out has shape ", grad_out.sizes(),
              ", y has ", y_in.sizes());
  const bool relu = parse_activation(activation);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const Layout L = kernel_layout(y_in, channel_dim);
  const auto acc = L.y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto m = channel_vector(mask, L.channels, acc, "mask");
  const auto b = bias ? channel_vector(*bias, L.channels, acc, "bias") : at::zeros_like(m);
  at::Tensor go = grad_out;
  if (go.strides() != L.y.strides() || go.scalar_type() != L.y.scalar_type()) {
    go = at::empty_like(L.y).copy_(grad_out);
  }
  auto dy = at::empty_like(L.y);
  const bool planes = L.inner > 1;
  const int64_t parts = planes ? L.outer : (L.outer + kRowBlock - 1) / kRowBlock;
  auto part_gy = at::zeros({std::max<int64_t>(parts, 1), L.channels}, m.options());
  auto part_g = at::zeros_like(part_gy);
  auto grad_mask = at::empty({L.channels}, m.options().dtype(at::kDouble));
  auto grad_bias = at::empty_like(grad_mask);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, L.y.scalar_type(), "epilogue_bwd_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        const auto* gp = go.data_ptr<scalar_t>();
        const auto* yp = L.y.data_ptr<scalar_t>();
        auto* dp = dy.data_ptr<scalar_t>();
        if (L.outer * L.channels > 0 && planes) {
          auto launch = [&](auto kernel) {
            kernel<<<L.outer * L.channels, kThreads, 0, stream>>>(
                gp, yp, m.data_ptr<acc_t>(), b.data_ptr<acc_t>(), L.channels, L.inner, dp,
                part_gy.data_ptr<acc_t>(), part_g.data_ptr<acc_t>());
          };
          relu ? launch(epilogue_bwd_planes_kernel<true, scalar_t, acc_t>)
               : launch(epilogue_bwd_planes_kernel<false, scalar_t, acc_t>);
        } else if (L.outer * L.channels > 0) {
          auto launch = [&](auto kernel) {
            kernel<<<parts, kThreads, 0, stream>>>(
                gp, yp, m.data_ptr<acc_t>(), b.data_ptr<acc_t>(), L.outer, L.channels, dp,
                part_gy.data_ptr<acc_t>(), part_g.data_ptr<acc_t>());
          };
          relu ? launch(epilogue_bwd_rows_kernel<true, scalar_t, acc_t>)
               : launch(epilogue_bwd_rows_kernel<false, scalar_t, acc_t>);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (L.channels > 0) {
          sum_partials_kernel<acc_t>
              <<<(L.channels + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
                  part_gy.data_ptr<acc_t>(), part_g.data_ptr<acc_t>(), m.data_ptr<acc_t>(),
                  planes ? L.outer : parts, L.channels, grad_mask.data_ptr<double>(),
                  grad_bias.data_ptr<double>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
  const auto bias_dtype = bias ? bias->scalar_type() : mask.scalar_type();
  return {dy, grad_mask.to(mask.scalar_type()), grad_bias.to(bias_dtype)};
}

TORCH_LIBRARY_IMPL(dtp, CUDA, m) {
  m.impl("masked_channel_epilogue", &masked_channel_epilogue_cuda);
  m.impl("masked_channel_epilogue_backward", &masked_channel_epilogue_backward_cuda);
}

}  // namespace dtp
