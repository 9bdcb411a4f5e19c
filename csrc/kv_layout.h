// Describes a registered paged KV cache and the host object format it maps to.
//
// A layer's cache is addressed as base + s*segment_stride + block*block_stride + r*row_stride,
// each (segment, block, row) being row_bytes contiguous bytes. Token layouts (MHA, block-major,
// MLA) have one row per token (rows_per_block == block_size, row_bytes == W). Opaque layouts
// (blocks packed in an engine-specific order) have one row per block (rows_per_block == 1,
// row_bytes == block_size * W) and are only ever copied whole.
//
// Host object for one chunk of T tokens: [S, L, T, W] bytes, contiguous. A tensor-parallel-shared
// object holds every KV head of its rows (tokens, or whole blocks of opaque layouts): each of its
// rows is P bytes, and a rank's row_bytes of a row (its heads) lie at offset O of it. Its copies
// are those of the dense format with the object's rows P apart, shifted by O.
#pragma once

#include <cstdint>
#include <vector>

namespace lmc {

struct KVLayout {
  std::vector<uintptr_t> layer_ptrs;  // address of (segment 0, block 0, row 0) per layer
  int64_t num_blocks = 0;
  int64_t block_size = 0;      // tokens per block
  int64_t num_segments = 1;    // S: 2 for split K/V, 1 for MLA or opaque blocks
  int64_t segment_stride = 0;  // bytes between the K and V parts of one block
  int64_t block_stride = 0;    // bytes between consecutive blocks
  int64_t rows_per_block = 0;  // block_size for token layouts, 1 for opaque ones
  int64_t row_bytes = 0;       // contiguous bytes per row
  int64_t row_stride = 0;      // bytes between rows of one block
  // Tensor-parallel-shared objects: bytes between rows in the object (0: row_bytes, the dense
  // object), and where this cache's row_bytes start in each (its heads' slice).
  int64_t object_row_pitch = 0;
  int64_t object_row_offset = 0;

  int64_t num_layers() const { return static_cast<int64_t>(layer_ptrs.size()); }
  int64_t block_bytes() const { return rows_per_block * row_bytes; }  // one segment, one layer
  int64_t token_bytes() const { return block_bytes() / block_size; }  // W
  bool rows_contiguous() const { return rows_per_block == 1 || row_stride == row_bytes; }
  // P: bytes between the object's rows (row_bytes unless sliced).
  int64_t object_pitch() const { return object_row_pitch ? object_row_pitch : row_bytes; }
  // The object holds more than this cache's bytes of each row: its copies are row by row.
  bool sliced() const { return object_pitch() != row_bytes; }
  int64_t dense_object_bytes(int64_t chunk_size) const {
    return num_segments * num_layers() * chunk_size * token_bytes();
  }
  // Bytes from a layer's base to one past the last byte the layout can touch.
  int64_t layer_extent() const;
  int64_t object_bytes(int64_t chunk_size) const {
    return num_segments * num_layers() * (chunk_size / block_size) * rows_per_block * object_pitch();
  }
  // Throws InvalidArgument unless the geometry is consistent and rows never overlap.
  void validate() const;
};

// One copy request: n_chunks chunks, each chunk_size tokens = blocks_per_chunk blocks, between
// a paged KV cache and n_chunks host objects.
struct ChunkBatch {
  const int64_t* block_ids = nullptr;  // n_chunks * blocks_per_chunk ids, in token order
  int64_t num_block_ids = 0;
  const uint64_t* object_ptrs = nullptr;  // n_chunks addresses
  int64_t num_chunks = 0;
  int64_t chunk_size = 0;
  int64_t object_capacity = 0;  // bytes available at each object address

  int64_t blocks_per_chunk(const KVLayout& l) const { return chunk_size / l.block_size; }
};

// Throws InvalidArgument (and nothing has been written) unless every block id is in range, the
// id count matches the chunk count, and each object can hold a chunk of this layout.
void validate_batch(const KVLayout& layout, const ChunkBatch& batch);

}  // namespace lmc
