// Definitions of the CPU tile loops declared in transport_blocks_cpu.h, included only by
// the per-M files that instantiate them (DTP_INSTANTIATE_BLOCKS_CPU).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstdint>

#include "common.h"
#include "transport_blocks_cpu.h"
#include "transport_blocks_tile.h"

namespace dtp {
namespace blocks {

template <int M, class scalar_t, class T>
DTP_INLINE void tiles_loop(const BlocksForwardArgs& a, int64_t lo, int64_t hi) {
  constexpr int kTile = tile_segments(M);
  int64_t seg = lo;
  for (; seg + kTile <= hi; seg += kTile) forward_tile<M, kTile, scalar_t, T>(a, seg);
  for (; seg < hi; ++seg) forward_tile<M, 1, scalar_t, T>(a, seg);
}

template <int M, class scalar_t, class T>
DTP_INLINE void tiles_loop(const BlocksBackwardArgs& a, int64_t lo, int64_t hi) {
  constexpr int kTile = tile_segments(M);
  int64_t seg = lo;
  for (; seg + kTile <= hi; seg += kTile) backward_tile<M, kTile, scalar_t, T>(a, seg);
  for (; seg < hi; ++seg) backward_tile<M, 1, scalar_t, T>(a, seg);
}

// Float accumulation gets AVX-512/AVX2 clones, double a plain build.
template <int M, class scalar_t, class Args>
DTP_CLONES void tiles_f32(const Args& a, int64_t lo, int64_t hi) {
  tiles_loop<M, scalar_t, float>(a, lo, hi);
}
template <int M, class scalar_t, class Args>
void tiles_f64(const Args& a, int64_t lo, int64_t hi) {
  tiles_loop<M, scalar_t, double>(a, lo, hi);
}

template <int M, class Args>
void tiles_any(const Args& a, at::ScalarType scores, bool is_double, int64_t lo, int64_t hi) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, scores, "transport_mask_blocks_cpu",
      [&] { is_double ? tiles_f64<M, scalar_t>(a, lo, hi) : tiles_f32<M, scalar_t>(a, lo, hi); });
}

template <int M>
void tiles_cpu(const BlocksForwardArgs& a, at::ScalarType scores, bool is_double, int64_t lo,
               int64_t hi) {
  tiles_any<M>(a, scores, is_double, lo, hi);
}

template <int M>
void tiles_cpu(const BlocksBackwardArgs& a, at::ScalarType scores, bool is_double, int64_t lo,
               int64_t hi) {
  tiles_any<M>(a, scores, is_double, lo, hi);
}

}  // namespace blocks
}  // namespace dtp

// The forward and backward tile loops for segment size M_, in the file that includes this.
#define DTP_INSTANTIATE_BLOCKS_CPU(M_)                                                            \
  namespace dtp {                                                                                 \
  namespace blocks {                                                                              \
  template void tiles_cpu<M_>(const BlocksForwardArgs&, at::ScalarType, bool, int64_t, int64_t);  \
  template void tiles_cpu<M_>(const BlocksBackwardArgs&, at::ScalarType, bool, int64_t, int64_t); \
  }                                                                                               \
  }
