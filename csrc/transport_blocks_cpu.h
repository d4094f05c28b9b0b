// The CPU tile loops of the tiny-segment (N:M) kernels, declared for
// transport_mask_blocks_cpu.cpp and compiled in one translation unit per segment size M
// (transport_mask_blocks_cpu_m4.cpp, _m8.cpp, _m16.cpp), as flash-attention compiles one
// file per head dimension: every M expands the tile step for four score dtypes, two
// accumulate types and their instruction-set clones, and apart the three compile in
// parallel.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "transport_blocks_tile.h"

namespace dtp {
namespace blocks {

// Segments per tile on the CPU: each value of a tile is an array over its segments, so
// every loop runs across segments and vectorises whatever M is.
constexpr int kTile = 16;

// The forward (or backward) step of segments [lo, hi) of a call: whole tiles of kTile
// segments, then the last ones (fewer than a tile) one at a time. `scores` is the scores'
// dtype; `is_double` picks double accumulation (else float, with AVX-512/AVX2 clones).
template <int M>
void tiles_cpu(const BlocksForwardArgs& a, at::ScalarType scores, bool is_double, int64_t lo,
               int64_t hi);
template <int M>
void tiles_cpu(const BlocksBackwardArgs& a, at::ScalarType scores, bool is_double, int64_t lo,
               int64_t hi);

}  // namespace blocks
}  // namespace dtp
