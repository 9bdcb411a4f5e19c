// The local-disk object store of the L2 tier: one file per object under a directory.
//
// A file is a 4096-byte header (magic, sizes, key, format, checksums of header and payload) and
// the payload at offset 4096, so that the payload can move between disk and pinned host memory
// with O_DIRECT straight from/into the caller's pointer. A file is written under a temporary name
// and renamed into place, so a reader (or a scan after a crash) never sees half an object; the
// payload checksum is verified on every read, because the scan at start-up only reads headers.
//
// The index (key -> size, format, LRU position) lives in memory and is rebuilt by that scan.
// Its mutex is never held during file I/O. Items of one call run in parallel on the store's own
// threads: puts on one pool, gets on another, so that a long batch of background writes never
// delays the reads a waiting lookup needs (calls of one kind from several threads take turns).
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "stats_fields.h"
#include "thread_pool.h"

namespace lmc {

#define LMC_DISK_STORE_STATS(X)                                                                   \
  X(uint64_t, capacity)                                                                          \
  X(uint64_t, bytes_used) /* files in the index, headers included (in-flight puts not counted) */ \
  X(int64_t, objects)                                                                            \
  X(int64_t, reads)                                                                              \
  X(uint64_t, read_bytes) /* payload bytes of successful items */                                \
  X(double, read_seconds)                                                                        \
  X(int64_t, writes)                                                                             \
  X(uint64_t, write_bytes)                                                                       \
  X(double, write_seconds)                                                                       \
  X(int64_t, evictions)                                                                          \
  X(int64_t, errors)   /* I/O failures (not misses, not corruption) */                           \
  X(int64_t, corrupt)  /* objects found corrupt on read and dropped */                           \
  X(int64_t, rejected) /* puts refused before any I/O: larger than the capacity, key + format too long */ \
  X(int64_t, dropped_at_scan)                                                                    \
  X(double, scan_seconds)                                                                        \
  X(int64_t, direct_reads)                                                                       \
  X(int64_t, buffered_reads)                                                                     \
  X(int64_t, direct_writes)                                                                      \
  X(int64_t, buffered_writes)

struct DiskStoreStats {
  LMC_DISK_STORE_STATS(LMC_DECLARE_FIELD)
  std::string last_error;  // (bound apart: bytes that are not UTF-8 are replaced)
};

class DiskStore {
 public:
  static constexpr uint64_t kHeaderBytes = 4096;
  // Results of get() besides the payload size.
  static constexpr int64_t kMiss = -1, kWrongFormat = -2, kTooSmall = -3, kCorrupt = -4, kIoError = -5;

  struct PutItem {
    std::string key, format;
    uintptr_t ptr = 0;
    uint64_t size = 0;
  };
  struct GetItem {
    std::string key, format;
    uintptr_t ptr = 0;
    uint64_t capacity = 0;
  };

  // Creates the directory if needed and scans it (throws std::runtime_error if it cannot).
  DiskStore(const std::string& path, uint64_t capacity_bytes, int io_threads);
  DiskStore(const DiskStore&) = delete;
  DiskStore& operator=(const DiskStore&) = delete;

  std::vector<uint8_t> put(const std::vector<PutItem>& items);  // 1 = stored
  std::vector<int64_t> get(const std::vector<GetItem>& items);
  std::vector<std::optional<std::pair<uint64_t, std::string>>> lookup(const std::vector<std::string>& keys) const;
  int64_t remove(const std::vector<std::string>& keys);
  // (key, payload bytes) of every object, least recently used first: for an eviction policy kept
  // above the store, which then evicts with remove() before the store's own LRU would.
  std::vector<std::pair<std::string, uint64_t>> entries() const;
  DiskStoreStats stats() const;

  // 32 lowercase hex digits: XXH64(key, 0) then XXH64(key, 1).
  static std::string name_of(const std::string& key);
  const std::string& path() const { return root_; }

 private:
  struct Entry {
    uint64_t payload_bytes = 0;
    std::string format;
    uint64_t gen = 0;  // tells a replaced entry from the one a reader looked up
    std::list<std::string>::iterator lru;
  };
  struct Victim {
    std::string key, name;
  };
  enum class Outcome { kDone, kRetry };
  enum class Drop { kDropped, kGone, kReplaced };

  std::string file_path(const std::string& name) const;
  std::mutex& name_lock(const std::string& name);
  bool put_one(const PutItem& item);
  int64_t get_one(const GetItem& item);
  Outcome get_attempt(const GetItem& item, int64_t* result);
  // Index edits; mu_ held.
  void insert_locked(const std::string& key, uint64_t payload_bytes, const std::string& format);
  void erase_locked(std::unordered_map<std::string, Entry>::iterator it);
  // Pops least recently used entries until `need` more bytes fit (need + reserved_ <= capacity_).
  void make_room_locked(uint64_t need, std::vector<Victim>* victims);
  // Unlinks evicted files unless a newer put of the same key has landed since.
  void unlink_victims(const std::vector<Victim>& victims);
  // Drops the entry a reader found bad if it is still the one the reader looked up (kDropped),
  // else says whether it is gone or was replaced by a newer put (whose file is then left alone).
  Drop drop_if_current(const std::string& key, const std::string& name, uint64_t gen, bool unlink_file);
  void record_error(const std::string& msg, int64_t DiskStoreStats::*counter);
  void scan();

  const std::string root_;
  const uint64_t capacity_;
  ThreadPool pool_;       // puts (and the start-up scan)
  ThreadPool read_pool_;  // gets

  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> index_;
  std::list<std::string> lru_;  // front: least recently used
  uint64_t used_ = 0;           // bytes of the files in the index
  uint64_t reserved_ = 0;       // bytes of puts in flight
  std::condition_variable room_cv_;  // a reservation was given back
  uint64_t next_gen_ = 1;
  DiskStoreStats st_;

  // A put's rename and its index insert, an eviction's unlink and a reader's drop of a bad file
  // hold the lock of the file's name, so that none of them acts on a file another just replaced.
  // Always taken before mu_, never the other way round.
  std::array<std::mutex, 64> name_locks_;
};

}  // namespace lmc
