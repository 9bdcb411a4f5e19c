// The host arena: one large region of (shared, optionally pinned) memory handed out as objects.
//
// Slab allocator. The region is cut into equal slabs; a slab serves one size class (one object
// size, i.e. one registered layout) as an array of fixed-size slots, so objects stay contiguous
// and never straddle two pinned pieces. A class keeps its slabs with free slots ordered by use;
// allocation fills the fullest one first (O(log slabs)), so the emptiest drain by themselves. A
// slab whose last object is freed goes back to the shared pool for any class.
//
// Memory moves between classes a slab at a time: the caller (the L1 index, which knows which
// objects may move) drains a class's emptiest slab, copies its live objects into free slots of
// the class's other slabs (move_objects) and frees them, and the empty slab returns to the pool.
//
// The memory is a memfd that other processes can map through /proc/<pid>/fd/<fd>. When pinning
// is asked for, a background thread page-locks the slabs one by one and only then makes each
// available, so start-up never waits for pinning. Without pinning the slabs are available at once
// and the same thread faults them in, in the order they are handed out (a first touch of a page
// costs its allocation and zeroing: a store into memory never used ran at 1/30 of its speed).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "stats_fields.h"

namespace lmc {

constexpr uint64_t kSlotAlign = 256;  // slots are multiples of it: every object 16-byte (vector), line aligned

#define LMC_ARENA_STATS(X)                                   \
  X(uint64_t, capacity)                                      \
  X(uint64_t, slab_bytes)                                    \
  X(int64_t, num_slabs)                                      \
  X(int64_t, free_slabs)       /* available to any class */  \
  X(int64_t, pending_slabs)    /* not yet pinned */          \
  X(int64_t, failed_slabs)     /* pinning failed; withheld */ \
  X(uint64_t, bytes_allocated) /* slot bytes handed out */   \
  X(int64_t, objects)

struct ArenaStats {
  LMC_ARENA_STATS(LMC_DECLARE_FIELD)
};

#define LMC_CLASS_STATS(X)                                                       \
  X(uint64_t, object_bytes)                                                      \
  X(uint64_t, slot_bytes)                                                        \
  X(uint32_t, slots_per_slab)                                                    \
  X(int64_t, slabs) /* slabs this class holds (draining ones included) */        \
  X(int64_t, objects)                                                            \
  X(int64_t, free_slots) /* in its slabs that are not draining */

struct ClassStats {
  LMC_CLASS_STATS(LMC_DECLARE_FIELD)
};

#define LMC_PIN_STATUS(X)                                                                \
  X(bool, requested)                                                                     \
  X(bool, done)                                                                          \
  X(uint64_t, bytes_pinned)                                                              \
  X(uint64_t, bytes_total)                                                               \
  X(double, seconds)                                                                     \
  X(std::string, error) /* first pinning error, if any */                                \
  X(uint64_t, bytes_faulted) /* faulted in ahead of use (pinned memory is, once pinned) */ \
  X(bool, faulting_done)

struct PinStatus {
  LMC_PIN_STATUS(LMC_DECLARE_FIELD)
};

class HostArena {
 public:
  // capacity is rounded down to whole slabs; numa_node < 0 leaves placement to the kernel.
  // path: a file (on /dev/shm or hugetlbfs) that holds the arena instead of anonymous memory, so
  // that its bytes outlive the process; an existing file of the same size is re-attached as it is.
  // prefault (unpinned arenas): fault the memory in ahead of use, in the background. Off for
  // memory that is mostly idle (a tenant's window for engine-side copies): pages come on first use.
  HostArena(uint64_t capacity, uint64_t slab_bytes, bool pin, int numa_node, const std::string& path = "",
            bool prefault = true);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  uintptr_t base() const { return reinterpret_cast<uintptr_t>(base_); }
  uint64_t capacity() const { return capacity_; }
  uint64_t slab_bytes() const { return slab_bytes_; }
  int fd() const { return fd_; }
  // The arena's file existed with this size: its bytes are a previous server's.
  bool reattached() const { return reattached_; }

  // The size class for objects of this many bytes (created on first use).
  int size_class(uint64_t object_bytes);
  uint64_t slot_bytes(int size_class) const;
  // Offset of a free slot of that class, or -1 when no memory is free.
  int64_t allocate(int size_class);
  // Returns a slot; throws InvalidArgument on an offset that is not an allocated slot.
  void free(int64_t offset);
  // Takes the slot at offset for class cls (re-attaching a previous server's objects): false when
  // it is not the start of a free slot of that class in a slab that is free or of that class.
  bool claim(int64_t offset, int size_class);
  // Slots a class could still hand out without taking a slab from the pool (O(1)).
  int64_t free_slots(int size_class) const;
  uint32_t slots_per_slab(int size_class) const;
  int num_classes() const;

  // Moving memory between classes. Candidates: up to `max` slabs of the class with free slots,
  // emptiest first. A draining slab takes no new objects; when its last object is freed it
  // returns to the pool. undrain() gives it back to its class (no-op if it already left).
  std::vector<int> drain_candidates(int size_class, int max) const;
  std::vector<int64_t> slab_objects(int slab) const;  // offsets of the slab's objects
  void drain(int slab);
  void undrain(int slab);
  // Copies nbytes from each src offset to the dst offset at the same index (CPU copy threads;
  // both must be allocated objects of at least nbytes).
  void move_objects(const std::vector<int64_t>& src, const std::vector<int64_t>& dst, uint64_t nbytes) const;

  ArenaStats stats() const;
  std::vector<ClassStats> class_stats() const;
  PinStatus pin_status() const;
  // Registering GPU memory needs the driver, which cudaHostRegister holds for a whole slab: while
  // any pause is open the pinning thread waits between slabs (calls nest; each pause one resume).
  void pause_pinning();
  void resume_pinning();
  // Waits until pinning has finished (or timeout_s passed); true when finished.
  bool wait_pinned(double timeout_s) const;
  // At a server's stop, once nothing copies any more: gives an unpinned arena's memory back to the
  // machine now (the kernel frees a GiB in a few tenths of a second: otherwise the process's exit
  // waits for it, after the server said it stopped). An arena file (persistence) keeps its bytes,
  // as does pinned memory (the destructor unpins it). The mapping stays valid (reads see zeros).
  // False when it kept them.
  bool release_memory();

 private:
  struct Slab {
    int cls = -1;
    std::vector<uint32_t> free_slots;
    std::vector<uint8_t> used;  // per slot
    uint32_t num_used = 0;
    bool draining = false;
  };
  struct SizeClass {
    uint64_t object_bytes = 0;
    uint64_t slot_bytes = 0;
    uint32_t slots_per_slab = 0;
    std::set<std::pair<uint32_t, int>> partial;  // (objects, slab) of slabs with free slots, not draining
    int64_t slabs = 0;
    int64_t objects = 0;
    int64_t free_slots = 0;
  };

  void pin_loop();
  void fault_in_loop();
  bool wait_unpaused();  // (pinning thread) false once stopping
  void check_class(int cls) const;
  void check_slab(int slab) const;
  int64_t slot_at(int64_t offset, int* slab) const;  // validates an allocated object's offset
  void release_slab(int s);
  void init_slab(int s, int cls);  // a free slab becomes one of class cls, all slots free
  void take_slot(int s, uint32_t slot);  // a free slot of slab s becomes an object

  uint8_t* base_ = nullptr;
  int fd_ = -1;
  uint64_t capacity_ = 0;
  uint64_t slab_bytes_ = 0;
  bool pin_ = false;
  bool reattached_ = false;
  bool has_file_ = false;  // the arena lives in a file of its own (a path): its bytes outlive the process

  mutable std::mutex mu_;
  std::vector<Slab> slabs_;
  std::vector<int> free_slabs_;
  std::vector<SizeClass> classes_;
  uint64_t bytes_allocated_ = 0;
  int64_t objects_ = 0;

  // pinning
  std::thread pin_thread_;
  std::atomic<bool> stop_{false};
  mutable std::condition_variable pin_cv_;
  int64_t slabs_pinned_ = 0, slabs_failed_ = 0;
  int pin_pauses_ = 0;
  bool pin_done_ = false;
  double pin_seconds_ = 0;
  std::string pin_error_;
  int64_t slabs_faulted_ = 0;
  bool faulting_done_ = false;
};

}  // namespace lmc
