// CUDA kernels of the masked-channel epilogue, out = act((y + bias[c]) * mask[c]).
// Memory is [outer][C][inner] as in masked_epilogue_cpu.cpp. The backward writes dy and
// per-channel partial sums (one per plane, or per block of rows) with block reductions,
// then one block per channel reduces its partials in a fixed tree: deterministic, no
// atomics. No kernel divides per element to find the channel.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include "block_sums.cuh"
#include "common.h"

namespace dtp {
namespace {

constexpr int kThreads = 256;
constexpr int kSumThreads = 128;
constexpr int64_t kMaxRowBlocks = 1024;

constexpr int kPerThread = 4;  // elements per thread of a plane block: loads in flight

// Planes (inner > 1): block (p, j) takes elements [j * kThreads * kPerThread, ...) of plane
// p = outer index * channels + c, so the channel is known per block, with no per-element
// integer division.
template <bool kRelu, class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    epilogue_fwd_planes_kernel(const scalar_t* __restrict__ y, const acc_t* __restrict__ mask,
                               const acc_t* __restrict__ bias, int64_t channels, int64_t inner,
                               scalar_t* __restrict__ out) {
  const int64_t plane = blockIdx.x, c = plane % channels;
  const acc_t m = mask[c], b = bias[c];
  const int64_t base = plane * inner;
  const int64_t first = int64_t(blockIdx.y) * kThreads * kPerThread + threadIdx.x;
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int64_t j = first + u * kThreads;
    if (j < inner) {
      acc_t v = (static_cast<acc_t>(y[base + j]) + b) * m;
      if constexpr (kRelu) v = v > acc_t(0) ? v : acc_t(0);
      out[base + j] = static_cast<scalar_t>(v);
    }
  }
}

// Rows (inner == 1: channels-last, or [rows, C]): block k takes rows [k * rows_per_block,
// ...), its threads stride over the channels of each row.
template <bool kRelu, class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    epilogue_fwd_rows_kernel(const scalar_t* __restrict__ y, const acc_t* __restrict__ mask,
                             const acc_t* __restrict__ bias, int64_t rows, int64_t channels,
                             int64_t rows_per_block, scalar_t* __restrict__ out) {
  const int64_t first = blockIdx.x * rows_per_block;
  const int64_t last = min(rows, first + rows_per_block);
  for (int64_t c = threadIdx.x; c < channels; c += kThreads) {
    const acc_t m = mask[c], b = bias[c];
    for (int64_t r = first; r < last; ++r) {
      const int64_t i = r * channels + c;
      acc_t v = (static_cast<acc_t>(y[i]) + b) * m;
      if constexpr (kRelu) v = v > acc_t(0) ? v : acc_t(0);
      out[i] = static_cast<scalar_t>(v);
    }
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

// Rows: block k takes rows [k * rows_per_block, ...), each thread a set of channels.
template <bool kRelu, class scalar_t, class acc_t>
__global__ void __launch_bounds__(kThreads)
    epilogue_bwd_rows_kernel(const scalar_t* __restrict__ go, const scalar_t* __restrict__ y,
                             const acc_t* __restrict__ mask, const acc_t* __restrict__ bias,
                             int64_t rows, int64_t channels, int64_t rows_per_block,
                             scalar_t* __restrict__ dy, acc_t* __restrict__ part_gy,
                             acc_t* __restrict__ part_g) {
  const int64_t block = blockIdx.x;
  const int64_t end = min(rows, (block + 1) * rows_per_block);
  for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) {
    const acc_t m = mask[c], b = bias[c];
    acc_t sgy = 0, sg = 0;
    for (int64_t r = block * rows_per_block; r < end; ++r) {
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

// One block per channel: its threads stride over the partials, then a block reduction
// (a fixed tree): deterministic, no atomics.
template <class acc_t>
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const acc_t* __restrict__ part_gy, const acc_t* __restrict__ part_g,
                        const acc_t* __restrict__ mask, int64_t parts, int64_t channels,
                        double* __restrict__ grad_mask, double* __restrict__ grad_bias) {
  using Reduce = cub::BlockReduce<Pair<double>, kSumThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t c = blockIdx.x;
  Pair<double> local{0, 0};
  for (int64_t p = threadIdx.x; p < parts; p += kSumThreads) {
    local.a += part_gy[p * channels + c];
    local.b += part_g[p * channels + c];
  }
  const Pair<double> total = Reduce(temp).Sum(local);
  if (threadIdx.x == 0) {
    grad_mask[c] = total.a;
    grad_bias[c] = static_cast<double>(mask[c]) * total.b;
  }
}

// Rows per block of the rows kernels: enough blocks to fill the GPU, few partials.
int64_t rows_per_block(int64_t rows) {
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((rows + 15) / 16, kMaxRowBlocks));
  return (rows + blocks - 1) / blocks;
}

using Layout = EpilogueLayout;

}  // namespace

int64_t epilogue_cuda_max_inner() { return int64_t{65535} * kThreads * kPerThread; }

at::Tensor masked_channel_epilogue_cuda_kernels(const at::Tensor& y_in, const at::Tensor& mask,
                                                const c10::optional<at::Tensor>& bias,
                                                c10::string_view activation, int64_t channel_dim) {
  const bool relu = parse_activation(activation);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const Layout L = epilogue_layout(y_in, channel_dim);
  const auto acc = acc_type(L.y);
  const auto m = channel_vector(mask, L.channels, acc, "mask");
  const auto b = bias ? channel_vector(*bias, L.channels, acc, "bias") : at::zeros_like(m);
  auto out = at::empty_like(L.y);
  const int64_t numel = L.y.numel();
  if (numel == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, L.y.scalar_type(), "epilogue_cuda", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        const auto* yp = L.y.data_ptr<scalar_t>();
        const auto* mp = m.data_ptr<acc_t>();
        const auto* bp = b.data_ptr<acc_t>();
        auto* op = out.data_ptr<scalar_t>();
        if (L.inner > 1) {
          const int64_t chunks = (L.inner + kThreads * kPerThread - 1) / (kThreads * kPerThread);
          const dim3 grid(static_cast<unsigned>(L.outer * L.channels),
                          static_cast<unsigned>(chunks));
          auto launch = [&](auto kernel) {
            kernel<<<grid, kThreads, 0, stream>>>(yp, mp, bp, L.channels, L.inner, op);
          };
          relu ? launch(epilogue_fwd_planes_kernel<true, scalar_t, acc_t>)
               : launch(epilogue_fwd_planes_kernel<false, scalar_t, acc_t>);
        } else {
          const int64_t per = rows_per_block(L.outer);
          auto launch = [&](auto kernel) {
            kernel<<<(L.outer + per - 1) / per, kThreads, 0, stream>>>(yp, mp, bp, L.outer,
                                                                       L.channels, per, op);
          };
          relu ? launch(epilogue_fwd_rows_kernel<true, scalar_t, acc_t>)
               : launch(epilogue_fwd_rows_kernel<false, scalar_t, acc_t>);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_channel_epilogue_backward_cuda_kernels(
    const at::Tensor& grad_out, const at::Tensor& y_in, const at::Tensor& mask,
    const c10::optional<at::Tensor>& bias, c10::string_view activation, int64_t channel_dim) {
  const bool relu = parse_activation(activation);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const Layout L = epilogue_layout(y_in, channel_dim);
  const auto acc = acc_type(L.y);
  const auto m = channel_vector(mask, L.channels, acc, "mask");
  const auto b = bias ? channel_vector(*bias, L.channels, acc, "bias") : at::zeros_like(m);
  at::Tensor go = grad_out;
  if (go.strides() != L.y.strides() || go.scalar_type() != L.y.scalar_type()) {
    go = at::empty_like(L.y).copy_(grad_out);
  }
  auto dy = at::empty_like(L.y);
  const bool planes = L.inner > 1;
  const int64_t per = rows_per_block(L.outer);
  const int64_t parts = planes ? L.outer : (L.outer + per - 1) / per;
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
                gp, yp, m.data_ptr<acc_t>(), b.data_ptr<acc_t>(), L.outer, L.channels, per, dp,
                part_gy.data_ptr<acc_t>(), part_g.data_ptr<acc_t>());
          };
          relu ? launch(epilogue_bwd_rows_kernel<true, scalar_t, acc_t>)
               : launch(epilogue_bwd_rows_kernel<false, scalar_t, acc_t>);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (L.channels > 0) {
          sum_partials_kernel<acc_t><<<L.channels, kSumThreads, 0, stream>>>(
              part_gy.data_ptr<acc_t>(), part_g.data_ptr<acc_t>(), m.data_ptr<acc_t>(), parts,
              L.channels, grad_mask.data_ptr<double>(), grad_bias.data_ptr<double>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
  const auto bias_dtype = bias ? bias->scalar_type() : mask.scalar_type();
  return {dy, grad_mask.to(mask.scalar_type()), grad_bias.to(bias_dtype)};
}

}  // namespace dtp
