// Moves chunks between one registered GPU KV cache and host objects, in one of three modes:
//   direct: a kernel with few CTAs reads/writes pinned host memory itself (zero-copy);
//   staged: a kernel packs each chunk into a device staging ring at device-memory speed and the
//           copy engine moves the packed chunk with one DMA, pipelined across chunks;
//   dma:    copy engines only, one batched memcpy call of coalesced segments.
// Store (gather) and retrieve (scatter) each have their own high-priority streams, so both
// directions run at once. Every submission ends with a pooled completion event
// on the direction's main stream, so completions of one direction finish in submission order.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_transfer.h"  // Direction
#include "cuda/transfer_kernels.h"
#include "kv_layout.h"
#include "stats_fields.h"

namespace lmc::cuda {

enum class Mode : int {
  kDirect = 0,
  kStaged = 1,
  kDma = 2,
  // Reference ways of doing the same copy, kept for the benchmarks:
  kSegmentLoop = 3,       // one cudaMemcpyAsync per (layer, K/V, block) segment
  kBatchUncoalesced = 4,  // one cudaMemcpyBatchAsync of every segment, none merged
  kSingleBuffer = 5,      // per chunk: gather into one device buffer, then one memcpy; no overlap
};

struct EngineOptions {
  int64_t staging_bytes = 256ll << 20;  // per direction; at least two chunks are kept
  int direct_ctas = 4;
  int pack_ctas = 0;  // 0: one per SM
  int threads = 1024;
  bool blocking_sync = false;  // host waits sleep in the driver instead of spinning
  // The server's streams are of high priority (its short kernels get SMs between the engine's);
  // an engine moving its own KV uses low ones, so its compute keeps the SMs it wants.
  bool high_priority = true;
};

#define LMC_ENGINE_STATS(X)                                                   \
  X(int64_t, submitted)                                                        \
  X(int64_t, completed)                                                        \
  X(int64_t, batched_memcpy_calls)                                             \
  X(int64_t, fallback_memcpy_calls)                                            \
  X(int64_t, dma_segments) /* copies the dma modes issued, after coalescing */ \
  X(int64_t, staging_bytes)

struct EngineStats {
  LMC_ENGINE_STATS(LMC_DECLARE_FIELD)
};

class TransferEngine {
 public:
  TransferEngine(int device, const KVLayout& layout, int64_t chunk_size, const EngineOptions& options);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // Throws InvalidArgument unless the batch fits this cache and the mode is usable here.
  void validate(Mode mode, const ChunkBatch& batch) const;
  // Validates everything (nothing is enqueued on error), makes the work wait for wait_event
  // (0: none; e.g. an event the worker recorded after producing the KV), enqueues the copies and
  // returns a ticket. Thread-safe per direction. completion_handle, when given, receives the
  // inter-process handle of the completion event, for a client stream to wait on; then_stream,
  // when given (a stream of this process), is made to wait for the completion.
  uint64_t submit(Direction dir, Mode mode, const ChunkBatch& batch, uintptr_t wait_event,
                  std::string* completion_handle = nullptr, uintptr_t then_stream = 0);
  // Blocks (call without the GIL) until the ticket's copies have finished; rethrows CUDA errors.
  // Returns when the host saw them finish (CLOCK_MONOTONIC ns, for request traces).
  int64_t wait(uint64_t ticket);
  // Waits (call without the GIL) for the oldest ticket of one direction that nobody waits on yet,
  // polling spin_us for one to be submitted before it sleeps until one is, and collects it. A
  // thread that answers a direction's completions this way never needs to be told about a
  // ticket. Returns ticket 0 once stop_waiting() was called and no ticket of that direction is
  // left. A CUDA error is returned in `error`, with the ticket, not thrown.
  struct Completion {
    uint64_t ticket = 0;
    int64_t done_ns = 0;
    std::string error;
  };
  Completion wait_next(Direction dir, int64_t spin_us);
  void stop_waiting();
  bool query(uint64_t ticket);

  int device() const { return device_; }
  bool direct_supported() const { return direct_supported_; }
  EngineStats stats() const;

 private:
  struct Ticket {
    uint64_t id;
    int dir;
    int event;  // index into the direction's pool
    bool claimed = false;  // a wait() or wait_next() is on it
  };
  struct Side {  // one direction
    std::mutex mu;
    cudaStream_t main = nullptr;  // kernels, batched DMA, completion
    cudaStream_t copy = nullptr;  // staged DMA
    std::vector<cudaEvent_t> pool;  // completion events (inter-process)
    std::vector<std::string> pool_handles;
    std::vector<int> free_events;
    // staging ring (device memory), allocated on first staged use
    char* staging = nullptr;
    int slots = 0;
    std::vector<cudaEvent_t> slot_ready;  // pack done (gather) / upload done (scatter)
    std::vector<cudaEvent_t> slot_free;   // slot may be overwritten
    int next_slot = 0;
  };

  int take_event(Side& side);
  // (direction, pool index) of a ticket in flight; false when unknown or already collected.
  bool find_ticket(uint64_t ticket, int* dir, int* event) const;
  // Waits for a claimed ticket's event and forgets the ticket (also when the wait failed).
  int64_t collect(uint64_t ticket, int dir, int event);
  void ensure_staging(Side& side);
  void enqueue_direct(Side& side, bool gather, const ChunkBatch& b, int ctas);
  void enqueue_staged(Side& side, bool gather, const ChunkBatch& b, bool single_buffer);
  // One DMA between a staging slot and a host object: the whole object, or for a sliced layout
  // the slot's rows into every pitch-th row of the object (one strided copy).
  void copy_slot(bool gather, char* slot, char* host, cudaStream_t stream);
  void enqueue_dma(Side& side, bool gather, const ChunkBatch& b, bool coalesce, bool batched);
  LaunchTable table_for(const ChunkBatch& b, int64_t first_chunk, int64_t n_chunks) const;

  int device_;
  KVLayout layout_;
  int64_t chunk_size_;
  EngineOptions opt_;
  DeviceLayout dlay_;  // the host objects, as the direct kernels walk them
  DeviceLayout dslot_;  // a staging slot: the dense object of this cache's bytes (= dlay_ unless sliced)
  uint64_t* d_layer_ptrs_ = nullptr;
  int num_sms_ = 0;
  bool direct_supported_ = false;
  int64_t object_bytes_ = 0;
  int64_t slot_bytes_ = 0;  // a staging slot holds this cache's bytes of one chunk
  Side sides_[2];  // 0: gather (store), 1: scatter (retrieve)

  mutable std::mutex ticket_mu_;
  std::deque<Ticket> tickets_;  // in flight
  // Per direction: a ticket of it was submitted, or stop_waiting(). A store wakes only the
  // store waiter; the count lets a spinning waiter watch for work without taking ticket_mu_.
  std::condition_variable ticket_cv_[2];
  std::atomic<uint64_t> submitted_[2] = {0, 0};
  std::atomic<bool> stop_waiting_{false};  // also read by spinning waiters, off the lock
  uint64_t next_ticket_ = 1;
  EngineStats stats_;
};

}  // namespace lmc::cuda
