// The CPU kernels' large outputs come from a cache of freed blocks (cpu_output_cache.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace dtp {

// What the cache may hold by default: freed blocks up to 1 GiB in all.
constexpr size_t kDefaultOutputCacheLimit = size_t(1) << 30;

// An uninitialised CPU tensor whose memory is a cached block of its rounded size when one
// is free, else a fresh 2 MiB-aligned block (advised for huge pages if huge_page_outputs
// is on). The block goes back to the cache when the last tensor using it is freed.
at::Tensor cached_empty(at::IntArrayRef size, const at::TensorOptions& options,
                        std::optional<c10::MemoryFormat> memory_format = std::nullopt);

// Caps the bytes of freed blocks the cache keeps (0: none kept, all freed now); returns
// the previous cap.
int64_t set_output_cache_limit(int64_t bytes);

// (bytes held, blocks held, cap) of the cache.
std::tuple<int64_t, int64_t, int64_t> output_cache_info();

}  // namespace dtp
