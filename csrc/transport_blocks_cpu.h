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
// every loop runs across segments and vectorises whatever M is. Segments of 4 take 32: a
// tile's work is a few long dependent chains (exp and log polynomials) per row of
// segments, and with 16 (one AVX-512 vector) the core waited on them; two vectors per row
// overlap them (the 2:4 step 12% faster, benchmarks/results/nm_tile_32_cpu.md). For M = 8
// and 16 a tile of 16 already holds 8 or 16 rows, and 32 made them slower.
constexpr int tile_segments(int64_t m) { return m == 4 ? 32 : 16; }

// The forward (or backward) step of segments [lo, hi) of a call: whole tiles of
// tile_segments(M), then the last ones (fewer than a tile) one at a time. `scores` is the
// scores' dtype; `is_double` picks double accumulation (else float, with AVX-512/AVX2
// clones).
template <int M>
void tiles_cpu(const BlocksForwardArgs& a, at::ScalarType scores, bool is_double, int64_t lo,
               int64_t hi);
template <int M>
void tiles_cpu(const BlocksBackwardArgs& a, at::ScalarType scores, bool is_double, int64_t lo,
               int64_t hi);

}  // namespace blocks
}  // namespace dtp
