// Gather/scatter kernels between paged KV blocks and chunk objects ([S, L, T, W] bytes, or a
// rank's slice of [S, L, T, P] ones).
// The objects may be pinned host memory (read or written over PCIe: "direct") or a device
// staging buffer ("staged"). Kernels know raw addresses only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lmc::cuda {

constexpr int kMaxLaunchChunks = 128;
constexpr int kMaxLaunchBlockIds = 2048;

// The per-launch part of a request, passed by value as a kernel parameter (no upload).
struct LaunchTable {
  int32_t num_chunks = 0;
  int32_t blocks_per_chunk = 0;
  uint64_t objects[kMaxLaunchChunks];
  int32_t block_ids[kMaxLaunchBlockIds];
};

// Geometry of a registered cache, as the kernels walk it. A "span" is a contiguous run: a whole
// block segment when its rows are contiguous, otherwise one row. A warp copies one piece of a span
// at a time (at most piece_bytes), so that large blocks still spread over every warp.
struct DeviceLayout {
  const uint64_t* layer_ptrs = nullptr;  // device array, num_layers entries
  int32_t num_layers = 0;
  int32_t num_segments = 0;
  int32_t spans_per_block = 0;
  int64_t segment_stride = 0;
  int64_t block_stride = 0;
  int64_t span_stride = 0;  // bytes between spans of one block in the cache
  int64_t span_bytes = 0;
  int64_t piece_bytes = 0;  // a multiple of 16; span_bytes when smaller
  int32_t pieces_per_span = 1;
  int64_t block_bytes = 0;  // of one segment of one layer, in the object
  int64_t plane_bytes = 0;  // one (segment, layer) plane of an object: its blocks' rows, each P bytes
  // Where spans lie in the object: spans of one block obj_span_stride apart (span_bytes when the
  // object is dense), blocks obj_block_stride apart (block_bytes), each shifted by obj_offset
  // (a tensor-parallel rank's heads' slice of every row; 0 when dense).
  int64_t obj_span_stride = 0;
  int64_t obj_block_stride = 0;
  int64_t obj_offset = 0;
};

// Largest power-of-two access width (16, 8, 4, 2 or 1 bytes) every address and size allows.
int access_width(const DeviceLayout& layout, const uint64_t* host_layer_ptrs, const LaunchTable& t);

// Loads every kernel of this file into the current device's context now. With lazy module
// loading (CUDA's default) a kernel is loaded at its first launch, and loading may wait for
// all work of the context: an engine's first copy would stall its thread until the GPU drained.
void preload_kernels();

// gather: cache -> objects; otherwise objects -> cache. grid_ctas CTAs of threads threads.
void launch_kv_copy(bool gather, const DeviceLayout& layout, const LaunchTable& table, int width, int grid_ctas,
                    int threads, cudaStream_t stream);

}  // namespace lmc::cuda
