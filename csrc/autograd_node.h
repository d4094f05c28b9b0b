// make_node<T>(): a new autograd node of type T, held the way this torch holds nodes.
// torch 2.11 keeps autograd nodes in std::shared_ptr, torch 2.14 in c10::intrusive_ptr
// (Tensor::grad_fn's return type says which); set_history and collect_next_edges take
// whichever that is, so the extension's nodes are made here and build against both.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace dtp {

using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

template <class T>
auto make_node() {
  static_assert(std::is_base_of_v<torch::autograd::Node, T>);
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

}  // namespace dtp
