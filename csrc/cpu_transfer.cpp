#include "cpu_transfer.h"

#include <cstring>

#include "thread_pool.h"

namespace lmc {

void cpu_transfer(const KVLayout& layout, const ChunkBatch& b, Direction dir) {
  layout.validate();
  validate_batch(layout, b);
  const int64_t L = layout.num_layers(), S = layout.num_segments;
  const int64_t bpc = b.blocks_per_chunk(layout);
  const int64_t plane = b.chunk_size * layout.token_bytes();  // bytes of one (segment, layer) plane
  const int64_t blk = layout.block_bytes();
  const bool contiguous = layout.rows_contiguous();
  // One work item per (chunk, segment, layer) plane: large enough to amortise scheduling,
  // and enough of them to keep every thread busy.
  auto item = [&](int64_t i) {
    const int64_t c = i / (S * L), s = (i / L) % S, l = i % L;
    char* obj = reinterpret_cast<char*>(b.object_ptrs[c]) + (s * L + l) * plane;
    char* base = reinterpret_cast<char*>(layout.layer_ptrs[l]) + s * layout.segment_stride;
    const int64_t* ids = b.block_ids + c * bpc;
    for (int64_t j = 0; j < bpc; ++j) {
      char* kv = base + ids[j] * layout.block_stride;
      char* o = obj + j * blk;
      if (contiguous) {
        if (dir == Direction::kGather) std::memcpy(o, kv, blk);
        else std::memcpy(kv, o, blk);
      } else {
        for (int64_t r = 0; r < layout.rows_per_block; ++r) {
          char* row = kv + r * layout.row_stride;
          char* orow = o + r * layout.row_bytes;
          if (dir == Direction::kGather) std::memcpy(orow, row, layout.row_bytes);
          else std::memcpy(row, orow, layout.row_bytes);
        }
      }
    }
  };
  cpu_pool()->parallel_for(b.num_chunks * S * L, item);
}

}  // namespace lmc
