// Op schemas of dtp_kernels and the Python module dtp_kernels._C. Device kernels register
// themselves under these names with TORCH_LIBRARY_IMPL in their own files.
#include <torch/extension.h>
#include <torch/library.h>

#include <string>

#include "cpu_outputs.h"
#include "fold_products.h"
#include "transport_step.h"

#ifndef DTP_TORCH_VERSION
#define DTP_TORCH_VERSION "unknown"
#endif
#ifndef DTP_CUDA_ARCH_LIST
#define DTP_CUDA_ARCH_LIST ""
#endif

TORCH_LIBRARY(dtp, m) {
  // mask, next log-odds, next shift, per (segment, pass) the shift used and the two
  // column log-sum-exps (which the backward needs: float64 from the general kernels, the
  // compute dtype from the tiny-segment ones), and per segment whether its scores or next
  // state were not finite (bool; such a segment keeps its state).
  // neutral_nonfinite: NaN/Inf scores enter as 0.5 with zero gradient, so the mask stays
  // finite; otherwise they propagate into their segment's mask. blocks_per_segment: the
  // CUDA schedule (1 = one block per segment, B > 1 = B blocks per segment, 0 = chosen
  // by size); every schedule gives the same result up to rounding, and on the CPU any
  // B > 0 only selects the general kernels. segment_size: 0 reads the segments from
  // offsets; 4, 8 or 16 declares that every segment has that many elements (the blocks of
  // N:M sparsity), which kernels for tiny segments run without reading offsets (only
  // their count is checked) unless blocks_per_segment > 0 asks for the general kernels.
  m.def(
      "transport_mask(Tensor scores, Tensor offsets, Tensor keep, Tensor eps, "
      "Tensor log_odds, Tensor shift, int iters, bool neutral_nonfinite=False, "
      "int blocks_per_segment=0, int segment_size=0) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
  // grad_scores, grad_keep. mask: the forward's mask; the general CPU kernels form a
  // one-iteration step's terms from it when it is in the compute dtype (else, and on
  // other devices, from the scores and log-odds).
  m.def(
      "transport_mask_backward(Tensor grad_mask, Tensor scores, Tensor offsets, Tensor keep, "
      "Tensor eps, Tensor log_odds, Tensor stats, bool neutral_nonfinite=False, "
      "int blocks_per_segment=0, int segment_size=0, Tensor? mask=None) -> (Tensor, Tensor)");
  // out = act((y + bias[c]) * mask[c]), activation "none" or "relu".
  m.def(
      "masked_channel_epilogue(Tensor y, Tensor mask, Tensor? bias, str activation, "
      "int channel_dim) -> Tensor");
  // grad_y, grad_mask, grad_bias (grad_bias is mask * sum(g) even without a bias).
  m.def(
      "masked_channel_epilogue_backward(Tensor grad_out, Tensor y, Tensor mask, Tensor? bias, "
      "str activation, int channel_dim) -> (Tensor, Tensor, Tensor)");
}

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
#ifdef DTP_WITH_CUDA
  info["cuda_compiled"] = true;
#else
  info["cuda_compiled"] = false;
#endif
  info["cuda_arch_list"] = std::string(DTP_CUDA_ARCH_LIST);
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = std::string("unknown");
#endif
  info["torch_compiled_against"] = std::string(DTP_TORCH_VERSION);
#ifdef DTP_CUDA_TOOLCHAIN_FOUND
  info["cuda_toolchain_at_build"] = static_cast<bool>(DTP_CUDA_TOOLCHAIN_FOUND);
  info["build_cuda_setting"] = std::string(DTP_BUILD_CUDA_SETTING);
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Compiled kernels of dtp_kernels; the ops live in torch.ops.dtp.";
  m.def("build_info", &build_info, "How this module was compiled.");
  m.def("fold_products", &dtp::fold_products,
        "DTPPruner's BN fold: every (weight, bias) pair times its mask, one autograd node.");
  m.def("transport_mask_step", &dtp::transport_mask_step,
        "dtp::transport_mask with its next state written to the pending buffers (eager).");
  m.def("transport_commit", &dtp::transport_commit,
        "TransportState.commit: the pending state made current, the step counted.");
  m.def(
      "set_huge_page_outputs",
      [](bool enabled) { return dtp::huge_page_outputs.exchange(enabled); },
      "Whether the CPU kernels advise outputs of 4 MiB or more for huge pages; returns the "
      "previous setting.");
  m.def("set_output_cache_limit", &dtp::set_output_cache_limit,
        "Caps the bytes of freed CPU output blocks kept for reuse; returns the previous cap.");
  m.def("output_cache_info", &dtp::output_cache_info,
        "(bytes held, blocks held, cap) of the CPU output cache.");
}
