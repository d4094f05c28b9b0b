// Small aggregates summed together in one cub::BlockReduce pass (CUDA kernels only).
#pragma once

namespace dtp {

template <class T>
struct Pair {
  T a, b;
};
template <class T>
__device__ Pair<T> operator+(Pair<T> x, Pair<T> y) {
  return {x.a + y.a, x.b + y.b};
}

template <class T>
struct Quad {
  T a, b, c, d;
};
template <class T>
__device__ Quad<T> operator+(Quad<T> x, Quad<T> y) {
  return {x.a + y.a, x.b + y.b, x.c + y.c, x.d + y.d};
}

}  // namespace dtp
