#include "cuda/transfer_engine.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "common.h"
#include "cuda/cuda_runtime.h"
#include "spin_poll.h"

namespace lmc::cuda {

namespace {
constexpr size_t kMaxBatchCopies = 16384;  // segments per cudaMemcpyBatchAsync call
}

TransferEngine::TransferEngine(int device, const KVLayout& layout, int64_t chunk_size, const EngineOptions& options)
    : device_(device), layout_(layout), chunk_size_(chunk_size), opt_(options) {
  layout_.validate();
  LMC_CHECK_ARG(chunk_size > 0 && chunk_size % layout_.block_size == 0, "chunk_size ", chunk_size,
                " is not a positive multiple of the block size ", layout_.block_size);
  LMC_CHECK_ARG(chunk_size / layout_.block_size <= kMaxLaunchBlockIds, "a chunk of ", chunk_size,
                " tokens spans more than ", kMaxLaunchBlockIds, " blocks; use larger blocks or smaller chunks");
  LMC_CHECK_ARG(layout_.num_blocks <= INT32_MAX, "num_blocks must fit in 32 bits");
  LMC_CHECK_ARG(opt_.threads >= 32 && opt_.threads <= 1024 && opt_.threads % 32 == 0,
                "threads per CTA must be a multiple of 32 in [32, 1024]");
  LMC_CHECK_ARG(opt_.direct_ctas > 0, "direct_ctas must be positive");
  DeviceGuard g(device_);
  preload_kernels();  // now, not at the first copy: loading then may wait for the engine's queued work
  check(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_), "cudaDeviceGetAttribute");
  int host_ptr_ok = 0;
  check(cudaDeviceGetAttribute(&host_ptr_ok, cudaDevAttrCanUseHostPointerForRegisteredMem, device_),
        "cudaDeviceGetAttribute");
  direct_supported_ = host_ptr_ok != 0;

  const int64_t L = layout_.num_layers();
  check(cudaMalloc(reinterpret_cast<void**>(&d_layer_ptrs_), L * sizeof(uint64_t)), "cudaMalloc(layer pointers)");
  std::vector<uint64_t> ptrs(layout_.layer_ptrs.begin(), layout_.layer_ptrs.end());
  check(cudaMemcpy(d_layer_ptrs_, ptrs.data(), L * sizeof(uint64_t), cudaMemcpyHostToDevice), "cudaMemcpy");

  dlay_.layer_ptrs = d_layer_ptrs_;
  dlay_.num_layers = static_cast<int32_t>(L);
  dlay_.num_segments = static_cast<int32_t>(layout_.num_segments);
  dlay_.segment_stride = layout_.segment_stride;
  dlay_.block_stride = layout_.block_stride;
  // A span is a whole block segment when its rows are contiguous on both sides, else one row.
  auto walk = [&](bool rows_together, int64_t pitch, int64_t offset) {
    DeviceLayout d = dlay_;
    if (rows_together) {
      d.spans_per_block = 1;
      d.span_bytes = layout_.block_bytes();
      d.span_stride = 0;
    } else {
      d.spans_per_block = static_cast<int32_t>(layout_.rows_per_block);
      d.span_bytes = layout_.row_bytes;
      d.span_stride = layout_.row_stride;
    }
    constexpr int64_t kPiece = 8192;  // 16 vectors of 16 bytes per lane: enough loads in flight
    d.piece_bytes = std::min(kPiece, d.span_bytes);
    d.pieces_per_span = static_cast<int32_t>((d.span_bytes + d.piece_bytes - 1) / d.piece_bytes);
    d.block_bytes = layout_.block_bytes();
    d.obj_span_stride = rows_together ? d.span_bytes : pitch;
    d.obj_block_stride = layout_.rows_per_block * pitch;
    d.plane_bytes = chunk_size_ / layout_.block_size * d.obj_block_stride;
    d.obj_offset = offset;
    return d;
  };
  dslot_ = walk(layout_.rows_contiguous(), layout_.row_bytes, 0);
  dlay_ = layout_.sliced() ? walk(false, layout_.object_pitch(), layout_.object_row_offset) : dslot_;
  object_bytes_ = layout_.object_bytes(chunk_size_);
  slot_bytes_ = layout_.dense_object_bytes(chunk_size_);

  for (int d = 0; d < 2; ++d) {
    // High priority (server side): our short packing kernels get SMs at the next kernel boundary
    // of the engine's work instead of queueing behind it, so the copy engines never run dry.
    sides_[d].main = reinterpret_cast<cudaStream_t>(create_stream(device_, opt_.high_priority));
    sides_[d].copy = reinterpret_cast<cudaStream_t>(create_stream(device_, opt_.high_priority));
  }
}

TransferEngine::~TransferEngine() {
  try {
    DeviceGuard g(device_);
    for (auto& s : sides_) {
      cudaStreamSynchronize(s.main);
      cudaStreamSynchronize(s.copy);
      for (auto e : s.pool) cudaEventDestroy(e);
      for (auto e : s.slot_ready) cudaEventDestroy(e);
      for (auto e : s.slot_free) cudaEventDestroy(e);
      if (s.staging) cudaFree(s.staging);
      cudaStreamDestroy(s.main);
      cudaStreamDestroy(s.copy);
    }
    if (d_layer_ptrs_) cudaFree(d_layer_ptrs_);
  } catch (...) {
  }
}

int TransferEngine::take_event(Side& side) {
  if (side.free_events.empty()) {
    const uintptr_t ev = create_event(device_, /*interprocess=*/true, opt_.blocking_sync);
    side.pool.push_back(reinterpret_cast<cudaEvent_t>(ev));
    side.pool_handles.push_back(event_ipc_handle(ev));
    return static_cast<int>(side.pool.size() - 1);
  }
  const int e = side.free_events.back();
  side.free_events.pop_back();
  return e;
}

void TransferEngine::ensure_staging(Side& side) {
  if (side.staging) return;
  side.slots = static_cast<int>(std::max<int64_t>(2, opt_.staging_bytes / slot_bytes_));
  check(cudaMalloc(reinterpret_cast<void**>(&side.staging), side.slots * slot_bytes_), "cudaMalloc(staging ring)");
  side.slot_ready.resize(side.slots);
  side.slot_free.resize(side.slots);
  for (int k = 0; k < side.slots; ++k) {
    check(cudaEventCreateWithFlags(&side.slot_ready[k], cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventCreateWithFlags(&side.slot_free[k], cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  std::lock_guard<std::mutex> lk(ticket_mu_);
  stats_.staging_bytes += side.slots * slot_bytes_;
}

LaunchTable TransferEngine::table_for(const ChunkBatch& b, int64_t first, int64_t n) const {
  LaunchTable t;
  const int64_t bpc = b.blocks_per_chunk(layout_);
  t.num_chunks = static_cast<int32_t>(n);
  t.blocks_per_chunk = static_cast<int32_t>(bpc);
  for (int64_t c = 0; c < n; ++c) t.objects[c] = b.object_ptrs[first + c];
  for (int64_t i = 0; i < n * bpc; ++i) t.block_ids[i] = static_cast<int32_t>(b.block_ids[first * bpc + i]);
  return t;
}

void TransferEngine::enqueue_direct(Side& side, bool gather, const ChunkBatch& b, int ctas) {
  const int64_t bpc = b.blocks_per_chunk(layout_);
  const int64_t per_launch = std::min<int64_t>(kMaxLaunchChunks, kMaxLaunchBlockIds / bpc);
  for (int64_t first = 0; first < b.num_chunks; first += per_launch) {
    const int64_t n = std::min(per_launch, b.num_chunks - first);
    LaunchTable t = table_for(b, first, n);
    const int width = access_width(dlay_, layout_.layer_ptrs.data(), t);
    launch_kv_copy(gather, dlay_, t, width, ctas, opt_.threads, side.main);
  }
}

void TransferEngine::enqueue_staged(Side& side, bool gather, const ChunkBatch& b, bool single_buffer) {
  ensure_staging(side);
  const int64_t bpc = b.blocks_per_chunk(layout_);
  const int64_t spans = layout_.num_segments * layout_.num_layers() * bpc * dslot_.spans_per_block *
                        dslot_.pieces_per_span;
  const int warps_per_cta = opt_.threads / 32;
  const int max_ctas = opt_.pack_ctas > 0 ? opt_.pack_ctas : num_sms_;
  const int ctas = static_cast<int>(std::min<int64_t>(max_ctas, (spans + warps_per_cta - 1) / warps_per_cta));
  // The single-buffer reference runs everything on one stream through slot 0: no overlap.
  cudaStream_t copy = single_buffer ? side.main : side.copy;
  for (int64_t c = 0; c < b.num_chunks; ++c) {
    const int k = single_buffer ? 0 : side.next_slot;
    if (!single_buffer) side.next_slot = (k + 1) % side.slots;
    char* slot = side.staging + k * slot_bytes_;
    LaunchTable t = table_for(b, c, 1);
    t.objects[0] = reinterpret_cast<uint64_t>(slot);
    const int width = access_width(dslot_, layout_.layer_ptrs.data(), t);
    char* host = reinterpret_cast<char*>(b.object_ptrs[c]);
    if (gather) {
      check(cudaStreamWaitEvent(side.main, side.slot_free[k], 0), "cudaStreamWaitEvent");
      launch_kv_copy(true, dslot_, t, width, ctas, opt_.threads, side.main);
      check(cudaEventRecord(side.slot_ready[k], side.main), "cudaEventRecord");
      check(cudaStreamWaitEvent(copy, side.slot_ready[k], 0), "cudaStreamWaitEvent");
      copy_slot(true, slot, host, copy);
      check(cudaEventRecord(side.slot_free[k], copy), "cudaEventRecord");
    } else {
      check(cudaStreamWaitEvent(copy, side.slot_free[k], 0), "cudaStreamWaitEvent");
      copy_slot(false, slot, host, copy);
      check(cudaEventRecord(side.slot_ready[k], copy), "cudaEventRecord");
      check(cudaStreamWaitEvent(side.main, side.slot_ready[k], 0), "cudaStreamWaitEvent");
      launch_kv_copy(false, dslot_, t, width, ctas, opt_.threads, side.main);
      check(cudaEventRecord(side.slot_free[k], side.main), "cudaEventRecord");
    }
  }
}

void TransferEngine::copy_slot(bool gather, char* slot, char* host, cudaStream_t stream) {
  const cudaMemcpyKind kind = gather ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  if (!layout_.sliced()) {
    check(gather ? cudaMemcpyAsync(host, slot, slot_bytes_, kind, stream)
                 : cudaMemcpyAsync(slot, host, slot_bytes_, kind, stream),
          gather ? "cudaMemcpyAsync(D2H)" : "cudaMemcpyAsync(H2D)");
    return;
  }
  const size_t w = static_cast<size_t>(layout_.row_bytes), p = static_cast<size_t>(layout_.object_pitch());
  const size_t rows = static_cast<size_t>(layout_.num_segments * layout_.num_layers() *
                                          (chunk_size_ / layout_.block_size) * layout_.rows_per_block);
  char* row0 = host + layout_.object_row_offset;
  check(gather ? cudaMemcpy2DAsync(row0, p, slot, w, w, rows, kind, stream)
               : cudaMemcpy2DAsync(slot, w, row0, p, w, rows, kind, stream),
        gather ? "cudaMemcpy2DAsync(D2H)" : "cudaMemcpy2DAsync(H2D)");
}

void TransferEngine::enqueue_dma(Side& side, bool gather, const ChunkBatch& b, bool coalesce, bool batched) {
  const int64_t bpc = b.blocks_per_chunk(layout_);
  const int64_t L = layout_.num_layers(), S = layout_.num_segments;
  const int64_t blk = layout_.block_bytes();
  const bool rows_contig = layout_.rows_contiguous() && !layout_.sliced();  // sliced: the object's rows are apart
  const bool blocks_adjacent = coalesce && rows_contig && layout_.block_stride == blk;  // neighbours in memory
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(b.num_chunks * S * L * bpc);
  srcs.reserve(dsts.capacity());
  sizes.reserve(dsts.capacity());
  // Copies merge only within one run of one (chunk, segment, layer), which lies in one device
  // allocation and one host object. Merging on into the next layer or object whenever the
  // addresses happen to continue could make one copy span two allocations.
  size_t run_begin = 0;
  auto add = [&](char* cache, char* obj, int64_t bytes) {
    // Coalesce with the previous copy when both sides continue where it ended.
    if (sizes.size() > run_begin) {
      char* pc = static_cast<char*>(gather ? const_cast<void*>(srcs.back()) : dsts.back());
      char* po = static_cast<char*>(gather ? dsts.back() : const_cast<void*>(srcs.back()));
      if (pc + sizes.back() == cache && po + sizes.back() == obj && blocks_adjacent) {
        sizes.back() += bytes;
        return;
      }
    }
    if (gather) {
      srcs.push_back(cache);
      dsts.push_back(obj);
    } else {
      srcs.push_back(obj);
      dsts.push_back(cache);
    }
    sizes.push_back(static_cast<size_t>(bytes));
  };
  for (int64_t c = 0; c < b.num_chunks; ++c) {
    const int64_t* ids = b.block_ids + c * bpc;
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t l = 0; l < L; ++l) {
        char* base = reinterpret_cast<char*>(layout_.layer_ptrs[l]) + s * layout_.segment_stride;
        char* obj = reinterpret_cast<char*>(b.object_ptrs[c]) + (s * L + l) * dlay_.plane_bytes + dlay_.obj_offset;
        run_begin = sizes.size();
        for (int64_t j = 0; j < bpc; ++j) {
          char* cache = base + ids[j] * layout_.block_stride;
          char* oblk = obj + j * dlay_.obj_block_stride;
          if (rows_contig) {
            add(cache, oblk, blk);
          } else {
            for (int64_t r = 0; r < layout_.rows_per_block; ++r)
              add(cache + r * layout_.row_stride, oblk + r * dlay_.obj_span_stride, layout_.row_bytes);
          }
        }
      }
    }
  }
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  attr.srcLocHint.type = gather ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
  attr.srcLocHint.id = gather ? device_ : 0;
  attr.dstLocHint.type = gather ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
  attr.dstLocHint.id = gather ? 0 : device_;
  size_t attr_idx = 0;
  const cudaMemcpyKind kind = gather ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  int64_t n_batched = 0, n_fallback = 0;
  for (size_t first = 0; first < sizes.size(); first += kMaxBatchCopies) {
    const size_t n = std::min(kMaxBatchCopies, sizes.size() - first);
    cudaError_t e = batched ? cudaMemcpyBatchAsync(dsts.data() + first, srcs.data() + first, sizes.data() + first,
                                                   n, &attr, &attr_idx, 1, side.main)
                            : cudaErrorNotSupported;
    if (e == cudaSuccess) {
      ++n_batched;
      continue;
    }
    if (e != cudaErrorNotSupported && e != cudaErrorCallRequiresNewerDriver && e != cudaErrorInvalidValue) {
      check(e, "cudaMemcpyBatchAsync");
    }
    cudaGetLastError();  // the driver lacks batched copies here: one call per segment
    for (size_t i = first; i < first + n; ++i) {
      check(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], kind, side.main), "cudaMemcpyAsync");
      ++n_fallback;
    }
  }
  std::lock_guard<std::mutex> lk(ticket_mu_);
  stats_.batched_memcpy_calls += n_batched;
  stats_.fallback_memcpy_calls += n_fallback;
  stats_.dma_segments += static_cast<int64_t>(sizes.size());
}

void TransferEngine::validate(Mode mode, const ChunkBatch& b) const {
  validate_batch(layout_, b);
  LMC_CHECK_ARG(b.chunk_size == chunk_size_, "chunk_size ", b.chunk_size, " differs from the engine's ", chunk_size_);
  LMC_CHECK_ARG(mode != Mode::kDirect || direct_supported_,
                "direct mode needs a device that can use registered host pointers");
}

uint64_t TransferEngine::submit(Direction dir, Mode mode, const ChunkBatch& b, uintptr_t wait_event,
                                std::string* completion_handle, uintptr_t then_stream) {
  validate(mode, b);
  const bool gather = dir == Direction::kGather;
  Side& side = sides_[gather ? 0 : 1];
  std::lock_guard<std::mutex> lk(side.mu);
  DeviceGuard g(device_);
  if (wait_event) check(cudaStreamWaitEvent(side.main, reinterpret_cast<cudaEvent_t>(wait_event), 0), "cudaStreamWaitEvent");
  // The completion event goes on the stream that does the last copy: main, except for a staged
  // gather, which ends with the copy stream's DMA (main's next kernels wait on the slots anyway).
  cudaStream_t last = side.main;
  switch (mode) {
    case Mode::kDirect: enqueue_direct(side, gather, b, opt_.direct_ctas); break;
    case Mode::kStaged:
      enqueue_staged(side, gather, b, false);
      if (gather) last = side.copy;
      break;
    case Mode::kDma: enqueue_dma(side, gather, b, true, true); break;
    case Mode::kSegmentLoop: enqueue_dma(side, gather, b, false, false); break;
    case Mode::kBatchUncoalesced: enqueue_dma(side, gather, b, false, true); break;
    case Mode::kSingleBuffer: enqueue_staged(side, gather, b, true); break;
    default: throw InvalidArgument("unknown transfer mode");
  }
  const int ev = take_event(side);
  check(cudaEventRecord(side.pool[ev], last), "cudaEventRecord");
  if (completion_handle) *completion_handle = side.pool_handles[ev];
  if (then_stream) {
    check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(then_stream), side.pool[ev], 0), "cudaStreamWaitEvent");
  }
  const int d = gather ? 0 : 1;
  std::lock_guard<std::mutex> tl(ticket_mu_);
  const uint64_t id = next_ticket_++;
  tickets_.push_back(Ticket{id, d, ev});
  ++stats_.submitted;
  submitted_[d].fetch_add(1, std::memory_order_release);
  ticket_cv_[d].notify_all();  // under the lock: a waiter cannot miss it between its check and its sleep
  return id;
}

bool TransferEngine::find_ticket(uint64_t ticket, int* dir, int* event) const {
  std::lock_guard<std::mutex> lk(ticket_mu_);
  for (const auto& t : tickets_)
    if (t.id == ticket) {
      *dir = t.dir;
      *event = t.event;
      return true;
    }
  return false;
}

int64_t TransferEngine::collect(uint64_t ticket, int dir, int idx) {
  // Lock order everywhere: a side's mutex before ticket_mu_; never the reverse.
  cudaEvent_t ev;
  {
    std::lock_guard<std::mutex> sl(sides_[dir].mu);
    ev = sides_[dir].pool[idx];
  }
  cudaError_t err;
  {
    DeviceGuard g(device_);
    err = cudaEventSynchronize(ev);
  }
  const int64_t done_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  {
    std::lock_guard<std::mutex> sl(sides_[dir].mu);
    std::lock_guard<std::mutex> lk(ticket_mu_);
    for (auto it = tickets_.begin(); it != tickets_.end(); ++it)
      if (it->id == ticket) {
        tickets_.erase(it);
        break;
      }
    ++stats_.completed;
    sides_[dir].free_events.push_back(idx);
  }
  check(err, "cudaEventSynchronize");
  return done_ns;
}

int64_t TransferEngine::wait(uint64_t ticket) {
  int dir = 0, idx = -1;
  {
    std::lock_guard<std::mutex> lk(ticket_mu_);
    auto it = std::find_if(tickets_.begin(), tickets_.end(), [&](const Ticket& t) { return t.id == ticket; });
    LMC_CHECK_ARG(it != tickets_.end() && !it->claimed, "unknown or already completed transfer ticket ", ticket);
    it->claimed = true;
    dir = it->dir;
    idx = it->event;
  }
  return collect(ticket, dir, idx);
}

TransferEngine::Completion TransferEngine::wait_next(Direction d, int64_t spin_us) {
  const int dir = d == Direction::kGather ? 0 : 1;
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  Completion out;
  int idx = -1;
  {
    std::unique_lock<std::mutex> lk(ticket_mu_);
    auto claim = [&] {
      for (auto& t : tickets_)
        if (t.dir == dir && !t.claimed) {
          t.claimed = true;
          out.ticket = t.id;
          idx = t.event;
          return true;
        }
      return false;
    };
    while (!claim()) {
      if (stop_waiting_) return out;  // ticket 0
      if (std::chrono::steady_clock::now() < spin_until) {
        // Spin on the direction's count, off the lock: the submitting thread takes it unhindered.
        const uint64_t seen = submitted_[dir].load(std::memory_order_acquire);
        lk.unlock();
        for (unsigned n = 1; submitted_[dir].load(std::memory_order_acquire) == seen; ++n) {
          cpu_relax();
          if (n % 64 == 0 && (stop_waiting_ || std::chrono::steady_clock::now() >= spin_until)) break;
        }
        lk.lock();
      } else {
        ticket_cv_[dir].wait(lk);
      }
    }
  }
  try {
    out.done_ns = collect(out.ticket, dir, idx);
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

void TransferEngine::stop_waiting() {
  {
    std::lock_guard<std::mutex> lk(ticket_mu_);
    stop_waiting_ = true;
  }
  for (auto& cv : ticket_cv_) cv.notify_all();
}

bool TransferEngine::query(uint64_t ticket) {
  int dir = 0, idx = -1;
  if (!find_ticket(ticket, &dir, &idx)) return true;  // completed and collected
  std::lock_guard<std::mutex> sl(sides_[dir].mu);
  return event_query(reinterpret_cast<uintptr_t>(sides_[dir].pool[idx]));
}

EngineStats TransferEngine::stats() const {
  std::lock_guard<std::mutex> lk(ticket_mu_);
  return stats_;
}

}  // namespace lmc::cuda
