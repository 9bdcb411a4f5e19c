#include "kv_layout.h"

#include <algorithm>
#include <array>

#include "common.h"

namespace lmc {

int64_t KVLayout::layer_extent() const {
  return (num_segments - 1) * segment_stride + (num_blocks - 1) * block_stride +
         (rows_per_block - 1) * row_stride + row_bytes;
}

void KVLayout::validate() const {
  LMC_CHECK_ARG(!layer_ptrs.empty(), "KV layout has no layers");
  LMC_CHECK_ARG(num_blocks > 0, "KV layout: num_blocks must be positive, got ", num_blocks);
  LMC_CHECK_ARG(block_size > 0, "KV layout: block_size must be positive, got ", block_size);
  LMC_CHECK_ARG(num_segments == 1 || num_segments == 2, "KV layout: num_segments must be 1 or 2, got ",
                num_segments);
  LMC_CHECK_ARG(rows_per_block == block_size || rows_per_block == 1,
                "KV layout: rows_per_block must be block_size (token rows) or 1 (opaque blocks)");
  LMC_CHECK_ARG(row_bytes > 0, "KV layout: row_bytes must be positive");
  LMC_CHECK_ARG(block_bytes() % block_size == 0, "KV layout: block bytes not divisible by block_size");
  LMC_CHECK_ARG(segment_stride >= 0 && block_stride >= 0 && row_stride >= 0, "KV layout: negative stride");
  for (auto p : layer_ptrs) LMC_CHECK_ARG(p != 0, "KV layout: null layer pointer");
  LMC_CHECK_ARG(object_row_pitch >= 0 && object_row_offset >= 0, "KV layout: negative object row pitch or offset");
  if (object_row_pitch == 0) {
    LMC_CHECK_ARG(object_row_offset == 0, "KV layout: an object row offset needs an object row pitch");
  } else {
    LMC_CHECK_ARG(object_row_offset + row_bytes <= object_row_pitch, "KV layout: the slice [", object_row_offset,
                  ", ", object_row_offset + row_bytes, ") does not fit an object row of ", object_row_pitch, " bytes");
  }
  // No two rows may overlap: sort the dimensions by stride and require each stride to step past
  // everything the smaller dimensions span. Writes into an engine's cache must stay in their rows.
  struct Dim { int64_t size, stride; };
  std::array<Dim, 3> dims{{{num_segments, segment_stride}, {num_blocks, block_stride}, {rows_per_block, row_stride}}};
  std::sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  int64_t span = row_bytes;
  for (const auto& d : dims) {
    if (d.size == 1) continue;
    LMC_CHECK_ARG(d.stride >= span, "KV layout: rows overlap (a stride of ", d.stride, " bytes is smaller than the ",
                  span, " bytes spanned by the inner dimensions)");
    span = d.stride * (d.size - 1) + span;
  }
}

void validate_batch(const KVLayout& layout, const ChunkBatch& b) {
  LMC_CHECK_ARG(b.chunk_size > 0, "chunk_size must be positive");
  LMC_CHECK_ARG(b.chunk_size % layout.block_size == 0, "chunk_size ", b.chunk_size,
                " is not a multiple of the block size ", layout.block_size);
  const int64_t bpc = b.blocks_per_chunk(layout);
  LMC_CHECK_ARG(b.num_chunks >= 0, "negative chunk count");
  LMC_CHECK_ARG(b.num_block_ids == b.num_chunks * bpc, "expected ", b.num_chunks * bpc, " block ids for ",
                b.num_chunks, " chunks of ", bpc, " blocks, got ", b.num_block_ids);
  const int64_t need = layout.object_bytes(b.chunk_size);
  LMC_CHECK_ARG(b.num_chunks == 0 || b.object_capacity >= need, "host object of ", b.object_capacity,
                " bytes is too small for a chunk of this layout (", need, " bytes)");
  for (int64_t i = 0; i < b.num_block_ids; ++i) {
    const int64_t id = b.block_ids[i];
    LMC_CHECK_ARG(id >= 0 && id < layout.num_blocks, "block id ", id, " at position ", i,
                  " is out of range [0, ", layout.num_blocks, ")");
  }
  for (int64_t c = 0; c < b.num_chunks; ++c) LMC_CHECK_ARG(b.object_ptrs[c] != 0, "null host object address");
}

}  // namespace lmc
