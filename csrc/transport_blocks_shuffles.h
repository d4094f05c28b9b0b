// Loads and stores of the CPU tiles of 16 segments of 4 float32 weights (2:4 and 1:4, the
// N:M patterns GPUs run), transposed between the tensors' segment order and the tiles'
// [element][segment] layout with whole-vector shuffles. Written element by element, GCC
// compiled these transposes to scalar inserts and extracts, about a tenth of each
// direction's time; results are bitwise the same. GCC's vector extensions: lowered to
// AVX-512, AVX2 or SSE2 in the clones of transport_blocks_cpu_tiles.h. Not for device code.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define DTP_TILE_SHUFFLES 1

#include <cstdint>
#include <cstring>

namespace dtp {
namespace blocks {

typedef float Floats16 __attribute__((vector_size(64)));
typedef int32_t Lanes16 __attribute__((vector_size(64)));

// dst[j][l] = src[4 l + j] for the 16 segments of 4 at src.
static inline __attribute__((always_inline)) void transpose_in(const float* src, float (*dst)[16]) {
  Floats16 v[4];
  std::memcpy(v, src, sizeof(v));
  const Lanes16 both = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  for (int j = 0; j < 4; ++j) {
    // element j of segments 0-7 (from v[0], v[1]) and 8-15 (from v[2], v[3])
    const Lanes16 pick = {j, 4 + j, 8 + j, 12 + j, 16 + j, 20 + j, 24 + j, 28 + j,
                          0, 0,     0,     0,      0,      0,      0,      0};
    const Floats16 low = __builtin_shuffle(v[0], v[1], pick);
    const Floats16 high = __builtin_shuffle(v[2], v[3], pick);
    const Floats16 row = __builtin_shuffle(low, high, both);
    std::memcpy(dst[j], &row, sizeof(row));
  }
}

// dst[4 l + j] = src[j][l]: the inverse of transpose_in.
static inline __attribute__((always_inline)) void transpose_out(const float (*src)[16],
                                                                float* dst) {
  Floats16 x[4];
  std::memcpy(x, src, sizeof(x));
  // pairs (x0[s], x1[s]) and (x2[s], x3[s]) for segments 0-7, then 8-15
  const Lanes16 zip_low = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  const Lanes16 zip_high = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const Floats16 p01 = __builtin_shuffle(x[0], x[1], zip_low);
  const Floats16 p01h = __builtin_shuffle(x[0], x[1], zip_high);
  const Floats16 p23 = __builtin_shuffle(x[2], x[3], zip_low);
  const Floats16 p23h = __builtin_shuffle(x[2], x[3], zip_high);
  // the two pairs of each segment side by side: 4 segments per output vector
  const Lanes16 quads_low = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23};
  const Lanes16 quads_high = {8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31};
  const Floats16 out[4] = {
      __builtin_shuffle(p01, p23, quads_low), __builtin_shuffle(p01, p23, quads_high),
      __builtin_shuffle(p01h, p23h, quads_low), __builtin_shuffle(p01h, p23h, quads_high)};
  std::memcpy(dst, out, sizeof(out));
}

}  // namespace blocks
}  // namespace dtp

#else
#define DTP_TILE_SHUFFLES 0
#endif
