// C++ CPU kernels of the DTP transport-mask step for segments that all have the same small
// size M (4, 8 or 16): the blocks of N:M sparsity. The general kernels
// (transport_mask_cpu.cpp) cut segments into chunks and keep host vectors per segment,
// which costs more than the math when every segment has 4 elements. Here M is a
// compile-time constant and tiles of 32 (M = 4) or 16 segments run the step of
// transport_blocks_tile.h, its loops vectorised across the segments (compiled per M:
// transport_blocks_cpu.h). Tiles are fixed (the last segments, fewer than a tile, run one
// by one), so the result does not depend on threading.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"
#include "cpu_outputs.h"
#include "transport_blocks.h"
#include "transport_blocks_cpu.h"
#include "transport_blocks_tile.h"

namespace dtp {
namespace {

using blocks::BlocksBackwardArgs;
using blocks::BlocksForwardArgs;

// Segments per parallel task, so that a task holds about 4,096 elements.
constexpr int64_t kTaskElements = 4096;
// Below this many elements the whole call runs on the calling thread.
constexpr int64_t kSerialElements = 32768;

// f(first segment, end segment) over ranges of whole tiles: a tile covers the same
// segments, and runs the same code, whatever the thread count, so results are bitwise
// independent of it.
template <class F>
void for_each_segment_range(int64_t nseg, int64_t m, const F& f) {
  const int64_t tile = blocks::tile_segments(m);
  const int64_t tiles = (nseg + tile - 1) / tile;
  const int64_t per_task = std::max<int64_t>(kTaskElements / (m * tile), 1);
  const int64_t grain = nseg * m < kSerialElements ? std::max<int64_t>(tiles, 1) : per_task;
  at::parallel_for(0, tiles, grain,
                   [&](int64_t lo, int64_t hi) { f(lo * tile, std::min(hi * tile, nseg)); });
}

// A kept count a segment of M accepts: 0 <= k <= M (false for NaN); an eps: finite and > 0.
DTP_INLINE bool valid_keep(double k, int64_t m) {
  return (k >= 0.0) & (k <= static_cast<double>(m));
}
DTP_INLINE bool valid_eps(double eps) { return (eps > 0.0) & (eps < INFINITY); }

// Runs the tiles of all segments (each M's loops are compiled in a file of their own:
// transport_blocks_cpu.h).
template <class Args>
void run_tiles(const Args& a, at::ScalarType scores, int64_t nseg, int64_t m, bool is_double) {
  for_each_segment_range(nseg, m, [&](int64_t lo, int64_t hi) {
    with_segment_size(m, [&](auto size) {
      blocks::tiles_cpu<decltype(size)::value>(a, scores, is_double, lo, hi);
    });
  });
}

// How many of n kept counts are outside [0, M], and how many of n eps are not finite and
// > 0: counting loops that vectorise (cloned per instruction set, so they must not throw:
// GCC's clones dispatched through an ifunc have aborted on an exception unwinding out of
// them).
template <class T>
DTP_CLONES int64_t count_bad_keeps(const T* keep, int64_t n, int64_t m) {
  int64_t bad = 0;
  for (int64_t s = 0; s < n; ++s) bad += valid_keep(static_cast<double>(keep[s]), m) ? 0 : 1;
  return bad;
}
DTP_CLONES int64_t count_bad_eps(const double* eps, int64_t n) {
  int64_t bad = 0;
  for (int64_t s = 0; s < n; ++s) bad += valid_eps(eps[s]) ? 0 : 1;
  return bad;
}

// Every segment's keep in [0, M] and eps finite and > 0, checked before anything is written
// (the next state may go straight into TransportState's pending buffers); on a bad value
// an error naming the first segment that has it (a value shared by all segments is
// checked once, as segment 0's).
template <class T>
void check_keeps(const T* keep, int64_t n, int64_t m) {
  if (count_bad_keeps(keep, n, m) == 0) return;
  for (int64_t s = 0; s < n; ++s) {
    const double k = static_cast<double>(keep[s]);
    TORCH_CHECK(valid_keep(k, m), "dtp::transport_mask: keep[", s, "] = ", k, " is outside [0, ", m,
                "]");
  }
}

void check_segments(const PerSegment& keep, const PerSegment& eps, int64_t nseg, int64_t m) {
  const int64_t n_keep = keep.stride == 0 ? std::min<int64_t>(nseg, 1) : nseg;
  if (keep.values.scalar_type() == at::kDouble) {
    check_keeps(keep.values.data_ptr<double>(), n_keep, m);
  } else {
    check_keeps(keep.values.data_ptr<float>(), n_keep, m);
  }
  const int64_t n_eps = eps.stride == 0 ? std::min<int64_t>(nseg, 1) : nseg;
  const double* e = eps.values.data_ptr<double>();
  if (count_bad_eps(e, n_eps) == 0) return;
  for (int64_t s = 0; s < n_eps; ++s) {
    TORCH_CHECK(valid_eps(e[s]), "dtp::transport_mask: eps[", s, "] = ", e[s],
                " must be finite and > 0");
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transport_mask_blocks_cpu(
    const at::Tensor& scores_in, const at::Tensor& keep_in, const at::Tensor& eps_in,
    const at::Tensor& log_odds_in, const at::Tensor& shift_in, int64_t iters,
    bool neutral_nonfinite, int64_t m) {
  const int64_t nseg = keep_in.numel();
  TORCH_CHECK(eps_in.device().is_cpu() && keep_in.device().is_cpu(),
              "dtp::transport_mask: keep and eps must be CPU tensors");
  const BlocksInputs in = blocks_inputs(scores_in, keep_in, eps_in, log_odds_in);
  const at::ScalarType acc = in.acc;
  const at::Tensor &scores = in.scores, &log_odds = in.log_odds;
  const auto shift = shift_in.contiguous();
  check_segments(in.keep, in.eps, nseg, m);
  auto mask_acc = empty_output({scores.numel()}, log_odds.options());
  // in the accumulate type, as the backward reads them (common.h: stats_type)
  const at::Tensor stats = blocks_stats(
      nseg, iters, [&](at::IntArrayRef sizes) { return empty_output(sizes, log_odds.options()); });
  // Every check is above: what follows cannot fail half-way through a lent buffer.
  auto [new_d, new_shift, nonfinite] = take_state_outputs(scores, log_odds, shift);
  const BlocksForwardArgs a = in.forward_args(shift, mask_acc, new_d, new_shift, stats, nonfinite,
                                              iters, neutral_nonfinite);
  run_tiles(a, scores.scalar_type(), nseg, m, acc == at::kDouble);
  auto mask =
      mask_acc.scalar_type() == scores.scalar_type() ? mask_acc : mask_acc.to(scores.scalar_type());
  return {mask, new_d, new_shift, stats, nonfinite};
}

std::tuple<at::Tensor, at::Tensor> transport_mask_blocks_backward_cpu(
    const at::Tensor& grad_mask, const at::Tensor& scores_in, const at::Tensor& keep_in,
    const at::Tensor& eps_in, const at::Tensor& log_odds_in, const at::Tensor& stats_in,
    bool neutral_nonfinite, int64_t m) {
  const int64_t nseg = keep_in.numel();
  const BlocksInputs in = blocks_inputs(scores_in, keep_in, eps_in, log_odds_in);
  const at::ScalarType acc = in.acc;
  const at::Tensor &scores = in.scores, &log_odds = in.log_odds;
  const at::Tensor stats = blocks_stats_layout(stats_in);
  const auto g = grad_mask.to(acc).contiguous();
  auto grad_x = empty_output({scores.numel()}, log_odds.options());
  auto grad_keep = empty_output({nseg}, log_odds.options());
  const BlocksBackwardArgs a = in.backward_args(g, stats, grad_x, grad_keep, neutral_nonfinite);
  run_tiles(a, scores.scalar_type(), nseg, m, acc == at::kDouble);
  auto grad_keep_out =
      keep_in.scalar_type() == acc ? grad_keep : grad_keep.to(keep_in.scalar_type());
  return {grad_x.to(scores.scalar_type()), grad_keep_out};
}

}  // namespace dtp
