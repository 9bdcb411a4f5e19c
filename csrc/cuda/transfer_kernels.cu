#include "cuda/transfer_kernels.h"

#include <stdexcept>

#include "common.h"
#include "cuda/cuda_runtime.h"

namespace lmc::cuda {
namespace {

constexpr int kUnroll = 4;  // independent vector loads in flight per thread

template <typename V>
__device__ __forceinline__ void copy_span(const char* __restrict__ src, char* __restrict__ dst, int64_t bytes,
                                          int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  int64_t i = lane;
  for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[i + u * 32];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * 32] = r[u];
  }
  for (; i < n; i += 32) d[i] = s[i];
}

// One warp per piece; pieces ordered (chunk, segment, layer, block, span, piece) so that
// consecutive warps touch consecutive object bytes.
template <bool kGather, typename V>
__global__ void kv_copy_kernel(const DeviceLayout lay, const __grid_constant__ LaunchTable t) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t spb = lay.spans_per_block, bpc = t.blocks_per_chunk, L = lay.num_layers, S = lay.num_segments;
  const int64_t pps = lay.pieces_per_span;
  const int64_t total = static_cast<int64_t>(t.num_chunks) * S * L * bpc * spb * pps;
  for (int64_t item = warp; item < total; item += num_warps) {
    int64_t x = item;
    const int64_t piece = x % pps; x /= pps;
    const int64_t r = x % spb; x /= spb;
    const int64_t j = x % bpc; x /= bpc;
    const int64_t l = x % L; x /= L;
    const int64_t s = x % S;
    const int64_t c = x / S;
    const int64_t block = t.block_ids[c * bpc + j];
    const int64_t off = piece * lay.piece_bytes;
    const int64_t bytes = min(lay.piece_bytes, lay.span_bytes - off);
    char* cache = reinterpret_cast<char*>(lay.layer_ptrs[l]) + s * lay.segment_stride + block * lay.block_stride +
                  r * lay.span_stride + off;
    char* obj = reinterpret_cast<char*>(t.objects[c]) + (s * L + l) * lay.plane_bytes + j * lay.obj_block_stride +
                r * lay.obj_span_stride + lay.obj_offset + off;
    if (kGather) copy_span<V>(cache, obj, bytes, lane);
    else copy_span<V>(obj, cache, bytes, lane);
  }
}

template <bool kGather>
void launch_width(int width, dim3 grid, dim3 block, cudaStream_t stream, const DeviceLayout& lay,
                  const LaunchTable& t) {
  switch (width) {
    case 16: kv_copy_kernel<kGather, uint4><<<grid, block, 0, stream>>>(lay, t); break;
    case 8: kv_copy_kernel<kGather, uint2><<<grid, block, 0, stream>>>(lay, t); break;
    case 4: kv_copy_kernel<kGather, uint32_t><<<grid, block, 0, stream>>>(lay, t); break;
    case 2: kv_copy_kernel<kGather, uint16_t><<<grid, block, 0, stream>>>(lay, t); break;
    default: kv_copy_kernel<kGather, uint8_t><<<grid, block, 0, stream>>>(lay, t); break;
  }
}

}  // namespace

void preload_kernels() {
  cudaFuncAttributes attr;
  const void* kernels[] = {
      reinterpret_cast<const void*>(kv_copy_kernel<true, uint4>),
      reinterpret_cast<const void*>(kv_copy_kernel<true, uint2>),
      reinterpret_cast<const void*>(kv_copy_kernel<true, uint32_t>),
      reinterpret_cast<const void*>(kv_copy_kernel<true, uint16_t>),
      reinterpret_cast<const void*>(kv_copy_kernel<true, uint8_t>),
      reinterpret_cast<const void*>(kv_copy_kernel<false, uint4>),
      reinterpret_cast<const void*>(kv_copy_kernel<false, uint2>),
      reinterpret_cast<const void*>(kv_copy_kernel<false, uint32_t>),
      reinterpret_cast<const void*>(kv_copy_kernel<false, uint16_t>),
      reinterpret_cast<const void*>(kv_copy_kernel<false, uint8_t>),
  };
  for (const void* k : kernels) check(cudaFuncGetAttributes(&attr, k), "cudaFuncGetAttributes");
}

int access_width(const DeviceLayout& lay, const uint64_t* host_layer_ptrs, const LaunchTable& t) {
  uint64_t bits = static_cast<uint64_t>(lay.span_bytes) | static_cast<uint64_t>(lay.piece_bytes) |
                  static_cast<uint64_t>(lay.segment_stride) |
                  static_cast<uint64_t>(lay.block_stride) | static_cast<uint64_t>(lay.span_stride) |
                  static_cast<uint64_t>(lay.block_bytes) | static_cast<uint64_t>(lay.plane_bytes) |
                  static_cast<uint64_t>(lay.obj_span_stride) | static_cast<uint64_t>(lay.obj_block_stride) |
                  static_cast<uint64_t>(lay.obj_offset);
  for (int l = 0; l < lay.num_layers; ++l) bits |= host_layer_ptrs[l];
  for (int c = 0; c < t.num_chunks; ++c) bits |= t.objects[c];
  for (int w = 16; w > 1; w >>= 1)
    if ((bits & (w - 1)) == 0) return w;
  return 1;
}

void launch_kv_copy(bool gather, const DeviceLayout& lay, const LaunchTable& t, int width, int grid_ctas,
                    int threads, cudaStream_t stream) {
  if (t.num_chunks == 0) return;
  dim3 grid(grid_ctas), block(threads);
  if (gather) launch_width<true>(width, grid, block, stream, lay, t);
  else launch_width<false>(width, grid, block, stream, lay, t);
  check(cudaGetLastError(), "kv_copy_kernel launch");
}

}  // namespace lmc::cuda
