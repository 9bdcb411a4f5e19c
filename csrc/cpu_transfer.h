// Copies between a paged KV cache in host memory and host objects, on the CPU thread pool.
#pragma once

#include <cstddef>

#include "kv_layout.h"

namespace lmc {

enum class Direction { kGather, kScatter };  // gather: cache -> objects; scatter: objects -> cache

// Validates everything first (nothing is written on error), then copies.
void cpu_transfer(const KVLayout& layout, const ChunkBatch& batch, Direction dir);

// A contiguous copy on the same thread pool: the ceiling the transfers are measured against.
void parallel_memcpy(void* dst, const void* src, size_t bytes);
// `count` copies of `bytes` each, src[i] -> dst[i] (non-overlapping), spread over the pool.
void parallel_copy_many(char* const* dst, const char* const* src, size_t count, size_t bytes);

}  // namespace lmc
