// Host-side pieces the CPU (.cpp) and CUDA (.cu) kernels of both ops share: the
// accumulate type, the inline/clone attributes of the CPU loops, the argument checks that
// do not read tensor values, and the epilogue's layout and activation parsing.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <string>

// Hot CPU loops are inlined into their callers ...
#define DTP_INLINE inline __attribute__((always_inline))

// ... and the callers get AVX-512 and AVX2 clones picked at load time (plain builds
// elsewhere, and never in device code).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define DTP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DTP_CLONES
#endif

// Defines NAME for T = float with DTP_CLONES and for T = double as a plain build, both
// forwarding to NAME##_loop. RET and PARAMS may use T; PREFIX is empty or a template
// header. Double gets no clones: its loops do not vectorise enough to pay for them.
#define DTP_FLOAT_CLONED(PREFIX, RET, NAME, PARAMS, ARGS)          \
  namespace NAME##_f32 {                                           \
    using T = float;                                               \
    PREFIX DTP_CLONES RET NAME PARAMS { return NAME##_loop ARGS; } \
  }                                                                \
  namespace NAME##_f64 {                                           \
    using T = double;                                              \
    PREFIX RET NAME PARAMS { return NAME##_loop ARGS; }            \
  }                                                                \
  using NAME##_f32::NAME;                                          \
  using NAME##_f64::NAME;

namespace dtp {

// float64 scores accumulate in float64, every other dtype in float32.
inline at::ScalarType acc_type(const at::Tensor& scores) {
  return scores.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// dtp::transport_mask's checks of shapes and dtypes (value checks need the host copy
// of keep and eps, which only the CPU kernels read).
inline void check_transport_args(const at::Tensor& scores, const at::Tensor& offsets,
                                 const at::Tensor& keep, const at::Tensor& eps,
                                 const at::Tensor& log_odds) {
  TORCH_CHECK(scores.dim() == 1 && scores.is_floating_point(),
              "dtp::transport_mask: scores must be a 1-D floating tensor, got ", scores.dim(),
              "-D ", scores.scalar_type());
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.numel() >= 2,
              "dtp::transport_mask: offsets must be a 1-D int64 tensor with at least 2 entries");
  const int64_t nseg = offsets.numel() - 1;
  TORCH_CHECK(keep.numel() == nseg && eps.numel() == nseg,
              "dtp::transport_mask: keep and eps need one entry per segment (", nseg, ")");
  TORCH_CHECK(log_odds.scalar_type() == acc_type(scores) && log_odds.numel() == scores.numel(),
              "dtp::transport_mask: log_odds must be ", acc_type(scores), " with ", scores.numel(),
              " elements");
}

// keep and eps carry one value per segment. A stride-0 view (what expand() gives:
// transport_mask passes a float eps so, DTPPruner its N:M counts) holds one value for all
// segments; the kernels then read that value at stride 0 instead of one per segment, so
// neither is copied out per segment nor read per segment (3 bytes per weight and
// direction at 2:4).
struct PerSegment {
  at::Tensor values;  // in the dtype asked, its data the one value (stride 0) or one per segment
  int64_t stride;     // 0 or 1
};

inline PerSegment per_segment(const at::Tensor& t, at::ScalarType dtype) {
  if (t.dim() == 1 && t.numel() > 1 && t.stride(0) == 0) {
    // the view itself when its dtype is the one asked (the per-step case: nothing made)
    return {t.scalar_type() == dtype ? t : t.narrow(0, 0, 1).to(dtype), 0};
  }
  return {t.to(dtype).contiguous(), 1};
}

// Whether the tiny-segment kernels (transport_blocks.h) run: every segment has the small
// size segment_size and no blocks_per_segment asks for the general kernels' schedule. The
// same rule on every device, so the stats' dtype (below) follows from the arguments alone.
inline bool use_blocks_kernels(int64_t segment_size, int64_t blocks_per_segment) {
  return segment_size > 0 && blocks_per_segment == 0;
}

// The forward's stats, (segments, iters, 3): float64 from the general kernels; the
// tiny-segment kernels form them in the accumulate type, and store them so (a segment of
// 4 weights would otherwise carry 24 bytes of them from the forward to the backward).
inline at::ScalarType stats_type(const at::Tensor& scores, bool blocks_kernels) {
  return blocks_kernels ? acc_type(scores) : at::kDouble;
}

inline void check_stats(const at::Tensor& stats, const at::Tensor& scores, int64_t nseg,
                        bool blocks_kernels) {
  const at::ScalarType dtype = stats_type(scores, blocks_kernels);
  TORCH_CHECK(stats.dim() == 3 && stats.size(0) == nseg && stats.size(2) == 3 &&
                  stats.size(1) >= 1 && stats.scalar_type() == dtype,
              "dtp::transport_mask_backward: stats must be ", dtype, " of shape (", nseg,
              ", iters, 3) as the forward returned them, got ", stats.scalar_type(), " of shape ",
              stats.sizes());
}

inline void check_blocks_per_segment(int64_t blocks_per_segment) {
  TORCH_CHECK(blocks_per_segment >= 0,
              "dtp::transport_mask: blocks_per_segment must be >= 0 (0 = chosen by size), got ",
              blocks_per_segment);
}

// segment_size is 0 (segments from offsets) or 4, 8, 16 with scores.numel() equal to that
// many per segment; anything else is refused.
inline void check_segment_size(int64_t segment_size, const at::Tensor& scores,
                               const at::Tensor& offsets) {
  TORCH_CHECK(segment_size == 0 || segment_size == 4 || segment_size == 8 || segment_size == 16,
              "dtp::transport_mask: segment_size must be 0 (sizes from offsets), 4, 8 or 16, got ",
              segment_size);
  const int64_t nseg = offsets.numel() - 1;
  TORCH_CHECK(segment_size == 0 || scores.numel() == nseg * segment_size,
              "dtp::transport_mask: segment_size ", segment_size, " with ", nseg,
              " segments needs ", nseg * segment_size, " scores, got ", scores.numel());
}

// The epilogue views y as [outer][channels][inner]: NCHW-contiguous has inner = H*W
// ("planes"); channels-last, or channels as the last dim, has inner = 1 ("rows").
struct EpilogueLayout {
  at::Tensor y;  // y itself, or a contiguous copy when its layout is neither
  int64_t outer, channels, inner;
};

// channel_dim of y, made non-negative; y has at least 2 dims and channel_dim is one of them.
inline int64_t epilogue_channel_dim(const at::Tensor& y, int64_t channel_dim) {
  TORCH_CHECK(y.dim() >= 2, "dtp::masked_channel_epilogue: y must have at least 2 dims, got ",
              y.dim());
  const int64_t cd = channel_dim < 0 ? channel_dim + y.dim() : channel_dim;
  TORCH_CHECK(cd >= 0 && cd < y.dim(), "dtp::masked_channel_epilogue: channel_dim ", channel_dim,
              " is out of range for a ", y.dim(), "-D tensor");
  return cd;
}

// Whether y (channel dim cd) is channels-last: read in place as rows of channels.
inline bool epilogue_channels_last(const at::Tensor& y, int64_t cd) {
  return cd == 1 && !y.is_contiguous() &&
         ((y.dim() == 4 && y.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
          (y.dim() == 5 && y.is_contiguous(at::MemoryFormat::ChannelsLast3d)));
}

inline EpilogueLayout epilogue_layout(const at::Tensor& y, int64_t channel_dim) {
  const int64_t cd = epilogue_channel_dim(y, channel_dim);
  const int64_t channels = y.size(cd);
  if (epilogue_channels_last(y, cd)) {
    return {y, channels == 0 ? 0 : y.numel() / channels, channels, 1};
  }
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < cd; ++d) outer *= y.size(d);
  for (int64_t d = cd + 1; d < y.dim(); ++d) inner *= y.size(d);
  return {y.contiguous(), outer, channels, inner};
}

inline void check_channel_vector(const at::Tensor& t, int64_t channels, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == channels && t.is_floating_point(),
              "dtp::masked_channel_epilogue: ", name, " must be a 1-D floating tensor of ",
              channels, " channels, got shape ", t.sizes());
}

// A per-channel mask or bias, checked and converted to `acc`.
inline at::Tensor channel_vector(const at::Tensor& t, int64_t channels, at::ScalarType acc,
                                 const char* name) {
  check_channel_vector(t, channels, name);
  return t.to(acc).contiguous();
}

// true for "relu", false for "none"; anything else is refused.
inline bool parse_activation(c10::string_view activation) {
  TORCH_CHECK(activation == "none" || activation == "relu",
              "dtp::masked_channel_epilogue: activation must be 'none' or 'relu', got '",
              std::string(activation), "'");
  return activation == "relu";
}

}  // namespace dtp
