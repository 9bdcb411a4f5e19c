#include "host_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "common.h"
#include "cpu_transfer.h"
#include "pinned_memory.h"

namespace lmc {

namespace {
constexpr uint64_t kPage = 4096;

std::string errno_text(const char* what) { return concat(what, ": ", std::strerror(errno)); }

// Prefer the GPU's NUMA node for the arena's pages (raw syscall: no libnuma dependency).
void prefer_numa_node(void* addr, uint64_t len, int node) {
  if (node < 0 || node >= 64) return;
  unsigned long mask = 1UL << node;
  constexpr int kMpolPreferred = 1;
  // Best effort: without NUMA support the kernel answers ENOSYS/EINVAL and placement is default.
  syscall(SYS_mbind, addr, len, kMpolPreferred, &mask, 64, 0);
}
}  // namespace

HostArena::HostArena(uint64_t capacity, uint64_t slab_bytes, bool pin, int numa_node, const std::string& path,
                     bool prefault)
    : pin_(pin) {
  LMC_CHECK_ARG(slab_bytes >= kPage && slab_bytes % kPage == 0, "slab size must be a positive multiple of ",
                kPage, " bytes, got ", slab_bytes);
  LMC_CHECK_ARG(capacity >= slab_bytes, "arena capacity (", capacity, " bytes) is smaller than one slab (",
                slab_bytes, " bytes)");
  LMC_CHECK_ARG(slab_bytes / kSlotAlign <= UINT32_MAX, "slab size too large");
  slab_bytes_ = slab_bytes;
  const uint64_t n = capacity / slab_bytes;
  capacity_ = n * slab_bytes;

  if (path.empty()) {
    fd_ = static_cast<int>(syscall(SYS_memfd_create, "lmcache_mp_arena", 0u));
    if (fd_ < 0) throw std::runtime_error(errno_text("memfd_create"));
  } else {
    has_file_ = true;
    fd_ = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ < 0) throw std::runtime_error(errno_text(("opening the arena file " + path).c_str()));
    struct stat st {};
    reattached_ = fstat(fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) == capacity_;
  }
  if (!reattached_ && ftruncate(fd_, static_cast<off_t>(capacity_)) != 0) {
    std::string e = errno_text("ftruncate of the arena");
    close(fd_);
    throw std::runtime_error(e);
  }
  void* p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd_, 0);
  if (p == MAP_FAILED) {
    std::string e = errno_text("mmap of the arena");
    close(fd_);
    throw std::runtime_error(e);
  }
  base_ = static_cast<uint8_t*>(p);
  prefer_numa_node(base_, capacity_, numa_node);

  slabs_.resize(n);
  if (pin_) {
    pin_thread_ = std::thread([this] { pin_loop(); });
  } else {
    for (int64_t i = static_cast<int64_t>(n) - 1; i >= 0; --i) free_slabs_.push_back(static_cast<int>(i));
    pin_done_ = true;
    if (prefault) {
      pin_thread_ = std::thread([this] { fault_in_loop(); });
    } else {
      faulting_done_ = true;
    }
  }
}

HostArena::~HostArena() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  pin_cv_.notify_all();
  if (pin_thread_.joinable()) pin_thread_.join();
  if (pin_) {
    for (int64_t i = 0; i < slabs_pinned_; ++i) unpin_host_memory(base_ + i * slab_bytes_);
  }
  if (base_) munmap(base_, capacity_);
  if (fd_ >= 0) close(fd_);
}

bool HostArena::release_memory() {
  if (pin_ || has_file_) return false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  pin_cv_.notify_all();
  if (pin_thread_.joinable()) pin_thread_.join();
  return fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(capacity_)) == 0;
}

bool HostArena::wait_unpaused() {
  std::unique_lock<std::mutex> lk(mu_);
  pin_cv_.wait(lk, [&] { return pin_pauses_ == 0 || stop_; });
  return !stop_;
}

void HostArena::fault_in_loop() {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older kernels answer EINVAL
#endif
  // Slabs are handed out from slab 0 up: fault them in in that order. MADV_POPULATE_WRITE
  // allocates (and maps) the pages without changing a byte, so a slab already in use is safe.
  for (size_t i = 0; i < slabs_.size() && wait_unpaused(); ++i) {
    if (madvise(base_ + i * slab_bytes_, slab_bytes_, MADV_POPULATE_WRITE) != 0) {
      std::lock_guard<std::mutex> lk(mu_);
      if (pin_error_.empty()) pin_error_ = errno_text("faulting L1 in (madvise MADV_POPULATE_WRITE)");
      break;  // an old kernel, or no memory: pages then come on first touch, as without this
    }
    std::lock_guard<std::mutex> lk(mu_);
    ++slabs_faulted_;
  }
  std::lock_guard<std::mutex> lk(mu_);
  faulting_done_ = true;
}

void HostArena::pin_loop() {
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < slabs_.size(); ++i) {
    if (!wait_unpaused()) break;
    std::string err;
    const bool ok = pin_host_memory(base_ + i * slab_bytes_, slab_bytes_, &err);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (ok) {
        // Pinning goes in order, so slabs_pinned_ also says which prefix to unpin at the end.
        ++slabs_pinned_;
        free_slabs_.insert(free_slabs_.begin(), static_cast<int>(i));
      } else {
        if (pin_error_.empty()) pin_error_ = err;
        slabs_failed_ = static_cast<int64_t>(slabs_.size() - i);
        break;  // later slabs would fail the same way; they stay withheld
      }
      pin_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    pin_cv_.notify_all();
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    pin_done_ = true;
  }
  pin_cv_.notify_all();
}

int HostArena::size_class(uint64_t object_bytes) {
  LMC_CHECK_ARG(object_bytes > 0, "object size must be positive");
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < classes_.size(); ++i)
    if (classes_[i].object_bytes == object_bytes) return static_cast<int>(i);
  const uint64_t slot = (object_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  LMC_CHECK_ARG(slot <= slab_bytes_, "an object of ", object_bytes, " bytes does not fit in a slab of ",
                slab_bytes_, " bytes; raise the slab size or lower the chunk size");
  SizeClass c;
  c.object_bytes = object_bytes;
  c.slot_bytes = slot;
  c.slots_per_slab = static_cast<uint32_t>(slab_bytes_ / slot);
  classes_.push_back(std::move(c));
  return static_cast<int>(classes_.size() - 1);
}

void HostArena::check_class(int cls) const {
  LMC_CHECK_ARG(cls >= 0 && cls < static_cast<int>(classes_.size()), "unknown size class ", cls);
}

void HostArena::check_slab(int s) const {
  LMC_CHECK_ARG(s >= 0 && s < static_cast<int>(slabs_.size()), "slab ", s, " is outside the arena");
}

uint64_t HostArena::slot_bytes(int cls) const {
  std::lock_guard<std::mutex> lk(mu_);
  check_class(cls);
  return classes_[cls].slot_bytes;
}

uint32_t HostArena::slots_per_slab(int cls) const {
  std::lock_guard<std::mutex> lk(mu_);
  check_class(cls);
  return classes_[cls].slots_per_slab;
}

int HostArena::num_classes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int>(classes_.size());
}

int64_t HostArena::allocate(int cls) {
  std::lock_guard<std::mutex> lk(mu_);
  check_class(cls);
  SizeClass& c = classes_[cls];
  if (c.partial.empty()) {
    if (free_slabs_.empty()) return -1;
    const int s = free_slabs_.back();
    free_slabs_.pop_back();
    init_slab(s, cls);
  }
  // The fullest slab with a free slot: emptier slabs drain, so whole slabs free up for other sizes.
  const int s = std::prev(c.partial.end())->second;
  const uint32_t slot = slabs_[s].free_slots.back();
  take_slot(s, slot);
  return static_cast<int64_t>(s) * static_cast<int64_t>(slab_bytes_) + static_cast<int64_t>(slot * c.slot_bytes);
}

void HostArena::take_slot(int s, uint32_t slot) {
  Slab& sl = slabs_[s];
  SizeClass& c = classes_[sl.cls];
  c.partial.erase({sl.num_used, s});
  if (sl.free_slots.back() == slot) {
    sl.free_slots.pop_back();
  } else {
    sl.free_slots.erase(std::find(sl.free_slots.begin(), sl.free_slots.end(), slot));
  }
  sl.used[slot] = 1;
  ++sl.num_used;
  if (!sl.free_slots.empty()) c.partial.emplace(sl.num_used, s);
  --c.free_slots;
  ++c.objects;
  bytes_allocated_ += c.slot_bytes;
  ++objects_;
}

void HostArena::init_slab(int s, int cls) {
  SizeClass& c = classes_[cls];
  Slab& sl = slabs_[s];
  sl.cls = cls;
  sl.num_used = 0;
  sl.draining = false;
  sl.used.assign(c.slots_per_slab, 0);
  sl.free_slots.resize(c.slots_per_slab);
  for (uint32_t k = 0; k < c.slots_per_slab; ++k) sl.free_slots[k] = c.slots_per_slab - 1 - k;
  c.partial.emplace(0, s);
  ++c.slabs;
  c.free_slots += c.slots_per_slab;
}

bool HostArena::claim(int64_t offset, int cls) {
  std::lock_guard<std::mutex> lk(mu_);
  check_class(cls);
  if (offset < 0 || static_cast<uint64_t>(offset) >= capacity_) return false;
  const int s = static_cast<int>(offset / static_cast<int64_t>(slab_bytes_));
  SizeClass& c = classes_[cls];
  const uint64_t in_slab = static_cast<uint64_t>(offset) - static_cast<uint64_t>(s) * slab_bytes_;
  if (in_slab % c.slot_bytes != 0 || in_slab / c.slot_bytes >= c.slots_per_slab) return false;
  const uint32_t slot = static_cast<uint32_t>(in_slab / c.slot_bytes);
  Slab& sl = slabs_[s];
  if (sl.cls < 0) {
    auto it = std::find(free_slabs_.begin(), free_slabs_.end(), s);
    if (it == free_slabs_.end()) return false;  // not pinned (yet), or withheld
    free_slabs_.erase(it);
    init_slab(s, cls);
  } else if (sl.cls != cls || sl.draining || sl.used[slot]) {
    return false;
  }
  take_slot(s, slot);
  return true;
}

int64_t HostArena::slot_at(int64_t offset, int* slab) const {
  LMC_CHECK_ARG(offset >= 0 && static_cast<uint64_t>(offset) < capacity_, "offset ", offset,
                " is outside the arena");
  const int s = static_cast<int>(offset / static_cast<int64_t>(slab_bytes_));
  const Slab& sl = slabs_[s];
  LMC_CHECK_ARG(sl.cls >= 0, "offset ", offset, " is not an allocated object");
  const SizeClass& c = classes_[sl.cls];
  const uint64_t in_slab = static_cast<uint64_t>(offset) - static_cast<uint64_t>(s) * slab_bytes_;
  LMC_CHECK_ARG(in_slab % c.slot_bytes == 0 && in_slab / c.slot_bytes < c.slots_per_slab, "offset ", offset,
                " is not the start of an object");
  const uint32_t slot = static_cast<uint32_t>(in_slab / c.slot_bytes);
  LMC_CHECK_ARG(sl.used[slot], "offset ", offset, " is not an allocated object (free, or already freed)");
  *slab = s;
  return slot;
}

void HostArena::release_slab(int s) {
  Slab& sl = slabs_[s];
  SizeClass& c = classes_[sl.cls];
  --c.slabs;
  sl.cls = -1;
  sl.draining = false;
  sl.used.clear();
  sl.used.shrink_to_fit();
  sl.free_slots.clear();
  sl.free_slots.shrink_to_fit();
  free_slabs_.push_back(s);
}

void HostArena::free(int64_t offset) {
  std::lock_guard<std::mutex> lk(mu_);
  int s = -1;
  const uint32_t slot = static_cast<uint32_t>(slot_at(offset, &s));
  Slab& sl = slabs_[s];
  SizeClass& c = classes_[sl.cls];
  if (!sl.draining && sl.num_used < c.slots_per_slab) c.partial.erase({sl.num_used, s});
  sl.used[slot] = 0;
  sl.free_slots.push_back(slot);
  --sl.num_used;
  --c.objects;
  bytes_allocated_ -= c.slot_bytes;
  --objects_;
  if (sl.draining) {
    if (sl.num_used == 0) release_slab(s);
    return;
  }
  if (sl.num_used == 0) {
    c.free_slots -= c.slots_per_slab - 1;
    release_slab(s);
  } else {
    ++c.free_slots;
    c.partial.emplace(sl.num_used, s);
  }
}

int64_t HostArena::free_slots(int cls) const {
  std::lock_guard<std::mutex> lk(mu_);
  check_class(cls);
  return classes_[cls].free_slots;
}

std::vector<int> HostArena::drain_candidates(int cls, int max) const {
  std::lock_guard<std::mutex> lk(mu_);
  check_class(cls);
  std::vector<int> out;
  for (auto it = classes_[cls].partial.begin(); it != classes_[cls].partial.end() && static_cast<int>(out.size()) < max;
       ++it)
    out.push_back(it->second);
  return out;
}

std::vector<int64_t> HostArena::slab_objects(int s) const {
  std::lock_guard<std::mutex> lk(mu_);
  check_slab(s);
  const Slab& sl = slabs_[s];
  std::vector<int64_t> out;
  if (sl.cls < 0) return out;
  const uint64_t slot_bytes = classes_[sl.cls].slot_bytes;
  for (size_t k = 0; k < sl.used.size(); ++k)
    if (sl.used[k]) out.push_back(static_cast<int64_t>(s * slab_bytes_ + k * slot_bytes));
  return out;
}

void HostArena::drain(int s) {
  std::lock_guard<std::mutex> lk(mu_);
  check_slab(s);
  Slab& sl = slabs_[s];
  LMC_CHECK_ARG(sl.cls >= 0 && !sl.draining, "slab ", s, " holds no objects or is already draining");
  SizeClass& c = classes_[sl.cls];
  if (sl.num_used < c.slots_per_slab) c.partial.erase({sl.num_used, s});
  c.free_slots -= c.slots_per_slab - sl.num_used;
  sl.draining = true;
}

void HostArena::undrain(int s) {
  std::lock_guard<std::mutex> lk(mu_);
  check_slab(s);
  Slab& sl = slabs_[s];
  if (sl.cls < 0 || !sl.draining) return;  // emptied and back in the pool (maybe taken again)
  SizeClass& c = classes_[sl.cls];
  sl.draining = false;
  c.free_slots += c.slots_per_slab - sl.num_used;
  if (sl.num_used < c.slots_per_slab) c.partial.emplace(sl.num_used, s);
}

void HostArena::move_objects(const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                             uint64_t nbytes) const {
  LMC_CHECK_ARG(src.size() == dst.size(), "move_objects: ", src.size(), " sources but ", dst.size(),
                " destinations");
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < src.size(); ++i) {
      for (int64_t off : {src[i], dst[i]}) {
        int s = -1;
        slot_at(off, &s);
        LMC_CHECK_ARG(nbytes <= classes_[slabs_[s].cls].slot_bytes, "move_objects: ", nbytes,
                      " bytes do not fit the object at offset ", off);
      }
    }
  }
  std::vector<char*> d(dst.size());
  std::vector<const char*> s(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    d[i] = reinterpret_cast<char*>(base_ + dst[i]);
    s[i] = reinterpret_cast<const char*>(base_ + src[i]);
  }
  parallel_copy_many(d.data(), s.data(), d.size(), nbytes);
}

std::vector<ClassStats> HostArena::class_stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<ClassStats> out;
  for (const SizeClass& c : classes_) {
    ClassStats s;
    s.object_bytes = c.object_bytes;
    s.slot_bytes = c.slot_bytes;
    s.slots_per_slab = c.slots_per_slab;
    s.slabs = c.slabs;
    s.objects = c.objects;
    s.free_slots = c.free_slots;
    out.push_back(s);
  }
  return out;
}

ArenaStats HostArena::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  ArenaStats st;
  st.capacity = capacity_;
  st.slab_bytes = slab_bytes_;
  st.num_slabs = static_cast<int64_t>(slabs_.size());
  st.free_slabs = static_cast<int64_t>(free_slabs_.size());
  st.failed_slabs = slabs_failed_;
  st.pending_slabs = pin_ ? st.num_slabs - slabs_pinned_ - slabs_failed_ : 0;
  st.bytes_allocated = bytes_allocated_;
  st.objects = objects_;
  return st;
}

PinStatus HostArena::pin_status() const {
  std::lock_guard<std::mutex> lk(mu_);
  PinStatus p;
  p.requested = pin_;
  p.done = pin_done_;
  p.bytes_pinned = static_cast<uint64_t>(slabs_pinned_) * slab_bytes_;
  p.bytes_total = pin_ ? capacity_ : 0;
  p.seconds = pin_seconds_;
  p.error = pin_error_;
  p.bytes_faulted = static_cast<uint64_t>(pin_ ? slabs_pinned_ : slabs_faulted_) * slab_bytes_;
  p.faulting_done = pin_ ? pin_done_ : faulting_done_;
  return p;
}

void HostArena::pause_pinning() {
  std::lock_guard<std::mutex> lk(mu_);
  ++pin_pauses_;
}

void HostArena::resume_pinning() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (pin_pauses_ > 0) --pin_pauses_;
  }
  pin_cv_.notify_all();
}

bool HostArena::wait_pinned(double timeout_s) const {
  std::unique_lock<std::mutex> lk(mu_);
  return pin_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return pin_done_; });
}

}  // namespace lmc
