#include "cpu_transfer.h"

#include <algorithm>
#include <cstring>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <xmmintrin.h>
#define LMC_HAVE_SSE2 1
#endif

namespace lmc {

namespace {

// Streaming copy: the destination is not read again soon (an object just stored), so bypass the
// cache and skip the read-for-ownership that plain stores pay. This is what lets a gather of many
// small blocks keep up with one large memcpy.
inline void copy_stream(char* dst, const char* src, size_t n) {
#ifdef LMC_HAVE_SSE2
  if (n >= 4096) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t vecs = n / 64;
    for (size_t i = 0; i < vecs; ++i) {
      _mm_prefetch(src + 1024, _MM_HINT_T0);  // keep reads in flight across page boundaries
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + 0);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + 1);
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + 2);
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + 3);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst) + 0, a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst) + 1, b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst) + 2, c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst) + 3, d);
      src += 64;
      dst += 64;
    }
    n -= vecs * 64;
  }
#endif
  std::memcpy(dst, src, n);
}

inline void fence() {
#ifdef LMC_HAVE_SSE2
  _mm_sfence();  // streaming stores are weakly ordered: publish them before reporting completion
#endif
}

}  // namespace

void cpu_transfer(const KVLayout& layout, const ChunkBatch& b, Direction dir) {
  layout.validate();
  validate_batch(layout, b);
  const int64_t L = layout.num_layers(), S = layout.num_segments;
  const int64_t bpc = b.blocks_per_chunk(layout);
  // the object's rows are `orow_stride` apart, this cache's bytes at object_row_offset of each
  const int64_t orow_stride = layout.object_pitch();
  const int64_t oblk_stride = layout.rows_per_block * orow_stride;
  const int64_t plane = bpc * oblk_stride;  // bytes of one (segment, layer) plane of the object
  const int64_t blk = layout.block_bytes();
  const bool contiguous = layout.rows_contiguous() && !layout.sliced();
  // One work item per (chunk, segment, layer) plane: large enough to amortise scheduling,
  // and enough of them to keep every thread busy.
  auto item = [&](int64_t i) {
    const int64_t c = i / (S * L), s = (i / L) % S, l = i % L;
    char* obj = reinterpret_cast<char*>(b.object_ptrs[c]) + (s * L + l) * plane + layout.object_row_offset;
    char* base = reinterpret_cast<char*>(layout.layer_ptrs[l]) + s * layout.segment_stride;
    const int64_t* ids = b.block_ids + c * bpc;
    for (int64_t j = 0; j < bpc; ++j) {
      char* kv = base + ids[j] * layout.block_stride;
      char* o = obj + j * oblk_stride;
      if (contiguous) {
        if (dir == Direction::kGather) copy_stream(o, kv, blk);
        else copy_stream(kv, o, blk);
      } else {
        for (int64_t r = 0; r < layout.rows_per_block; ++r) {
          char* row = kv + r * layout.row_stride;
          char* orow = o + r * orow_stride;
          if (dir == Direction::kGather) copy_stream(orow, row, layout.row_bytes);
          else copy_stream(row, orow, layout.row_bytes);
        }
      }
    }
    fence();
  };
  cpu_pool()->parallel_for(b.num_chunks * S * L, item);
}

void parallel_memcpy(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  parallel_copy_many(&d, &s, 1, bytes);
}

void parallel_copy_many(char* const* dst, const char* const* src, size_t count, size_t bytes) {
  constexpr size_t kPiece = 4 << 20;
  const int64_t pieces = static_cast<int64_t>((bytes + kPiece - 1) / kPiece);
  cpu_pool()->parallel_for(static_cast<int64_t>(count) * pieces, [&](int64_t i) {
    const size_t k = static_cast<size_t>(i / pieces);
    const size_t off = static_cast<size_t>(i % pieces) * kPiece;
    copy_stream(dst[k] + off, src[k] + off, std::min(kPiece, bytes - off));
    fence();
  });
}

}  // namespace lmc
