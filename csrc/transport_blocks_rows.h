// One segment's M consecutive float32 values (M a multiple of 4) moved as M / 4 accesses
// of 16 bytes: on the GPU vector loads and stores (ld/st.global.v4.f32), where element by
// element each thread of the tile kernels issues four scalar ones; on the CPU a 16-byte
// memcpy, the same indexing, which the CPU kernels' last, partial tiles run (so the CPU
// tests cover it). Only for 16-byte-aligned tensors (BlocksForwardArgs::aligned): then
// every segment's row is aligned, as M floats are a multiple of 16 bytes. Also copy_out,
// how the tiles store their other outputs from local arrays on either device.
#pragma once

#include <cstring>
#include <type_traits>

#include "transport_math.h"

namespace dtp {
namespace blocks {

struct alignas(16) Row4 {
  float v[4];
};

DTP_HOST_DEVICE inline Row4 load_row4(const float* p) {
#if defined(__CUDA_ARCH__)
  const float4 q = *reinterpret_cast<const float4*>(p);
  return {{q.x, q.y, q.z, q.w}};
#else
  Row4 q;
  std::memcpy(&q, p, sizeof(q));
  return q;
#endif
}

DTP_HOST_DEVICE inline void store_row4(float* p, const Row4& q) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<float4*>(p) = make_float4(q.v[0], q.v[1], q.v[2], q.v[3]);
#else
  std::memcpy(p, &q, sizeof(q));
#endif
}

// dst[j][0] = src[j] for the M values of one segment.
template <int M>
DTP_HOST_DEVICE inline void load_row(const float* src, float (&dst)[M][1]) {
  static_assert(M % 4 == 0, "rows of whole 16-byte quads");
  for (int q = 0; q < M / 4; ++q) {
    const Row4 r = load_row4(src + 4 * q);
    for (int k = 0; k < 4; ++k) dst[4 * q + k][0] = r.v[k];
  }
}

// dst[j] = src[j][0] for the M values of one segment.
template <int M>
DTP_HOST_DEVICE inline void store_row(float* dst, const float (&src)[M][1]) {
  static_assert(M % 4 == 0, "rows of whole 16-byte quads");
  for (int q = 0; q < M / 4; ++q) {
    Row4 r;
    for (int k = 0; k < 4; ++k) r.v[k] = src[4 * q + k][0];
    store_row4(dst + 4 * q, r);
  }
}

// dst[i] = src[i] for N values of type V from a tile's local array: on the CPU one
// memcpy (stores through output pointers, which may alias one another as far as the
// compiler knows, stay scalar), on the device element by element (nvcc lowers a memcpy
// to a pointer of unproven alignment to one-byte stores).
template <int N, class V>
DTP_HOST_DEVICE inline void copy_out(V* dst, const V* src) {
#if defined(__CUDA_ARCH__)
  for (int i = 0; i < N; ++i) dst[i] = src[i];
#else
  std::memcpy(dst, src, N * sizeof(V));
#endif
}

// Whether a tile of L segments of M elements, values of type T, moves its rows this way.
template <int M, int L, class T>
constexpr bool row_access() {
  return L == 1 && M % 4 == 0 && std::is_same_v<T, float>;
}

}  // namespace blocks
}  // namespace dtp
