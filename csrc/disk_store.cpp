#include "disk_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <tuple>

#include "common.h"
#include "xxhash64.h"

namespace lmc {
namespace {

constexpr char kMagic[8] = {'L', 'M', 'C', 'M', 'P', 'K', 'V', '1'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHdr = DiskStore::kHeaderBytes;
constexpr size_t kFixedFields = 48;  // key and format follow
constexpr size_t kChecksumAt = 40;
constexpr uint64_t kAlign = 4096;
// A direct transfer moves a piece of up to 64 MiB per call; a buffered one smaller pieces, so
// that a piece hashed just before its write (or just after its read) is still in cache.
constexpr uint64_t kDirectPiece = 64ull << 20;
constexpr uint64_t kBufferedPiece = 4ull << 20;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// strerror_r is the GNU or the XSI variant depending on the C library; both land here.
[[maybe_unused]] const char* strerror_text(int rc, const char* buf) { return rc == 0 ? buf : "unknown error"; }
[[maybe_unused]] const char* strerror_text(const char* s, const char*) { return s; }
std::string errno_text(int e) {
  char buf[128] = {0};
  return concat(strerror_text(strerror_r(e, buf, sizeof(buf)), buf), " (errno ", e, ")");
}

void put_le(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint64_t header_checksum(const uint8_t* hdr) {
  Xxh64 h(0);
  static const uint8_t zeros[8] = {0};
  h.update(hdr, kChecksumAt);
  h.update(zeros, 8);
  h.update(hdr + kChecksumAt + 8, kHdr - kChecksumAt - 8);
  return h.digest();
}

struct Header {
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;
  std::string key, format;
};

// hdr must be kHdr bytes, zero beyond the fields.
void encode_header(uint8_t* hdr, const std::string& key, const std::string& format, uint64_t payload_bytes,
                   uint64_t payload_checksum) {
  std::memset(hdr, 0, kHdr);
  std::memcpy(hdr, kMagic, 8);
  put_le(hdr + 8, kVersion, 4);
  put_le(hdr + 12, kHdr, 4);
  put_le(hdr + 16, payload_bytes, 8);
  put_le(hdr + 24, payload_checksum, 8);
  put_le(hdr + 32, key.size(), 4);
  put_le(hdr + 36, format.size(), 4);
  std::memcpy(hdr + kFixedFields, key.data(), key.size());
  std::memcpy(hdr + kFixedFields + key.size(), format.data(), format.size());
  put_le(hdr + kChecksumAt, header_checksum(hdr), 8);
}

// Empty string when valid, else what is wrong.
std::string decode_header(const uint8_t* hdr, Header* out) {
  if (std::memcmp(hdr, kMagic, 8) != 0) return "bad magic";
  if (get_le(hdr + 8, 4) != kVersion) return concat("unknown version ", get_le(hdr + 8, 4));
  if (get_le(hdr + 12, 4) != kHdr) return concat("header_bytes ", get_le(hdr + 12, 4));
  const uint64_t key_len = get_le(hdr + 32, 4), format_len = get_le(hdr + 36, 4);
  if (key_len + format_len > kHdr - kFixedFields) return "key and format overflow the header";
  if (get_le(hdr + kChecksumAt, 8) != header_checksum(hdr)) return "header checksum mismatch";
  out->payload_bytes = get_le(hdr + 16, 8);
  out->payload_checksum = get_le(hdr + 24, 8);
  out->key.assign(reinterpret_cast<const char*>(hdr + kFixedFields), key_len);
  out->format.assign(reinterpret_cast<const char*>(hdr + kFixedFields + key_len), format_len);
  return "";
}

bool is_lower_hex(const char* s, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const char c = s[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // close() can report a delayed write error (e.g. on network filesystems): 0 or errno.
  int close() {
    const int fd = fd_;
    fd_ = -1;
    return fd >= 0 && ::close(fd) != 0 ? errno : 0;
  }

 private:
  int fd_;
};

struct AlignedBuf {
  void* p = nullptr;
  ~AlignedBuf() { std::free(p); }
  bool alloc(size_t n) { return posix_memalign(&p, kAlign, n) == 0; }
  uint8_t* data() const { return static_cast<uint8_t*>(p); }
};

// Moves len bytes at file offset off, looping on short transfers and EINTR. Returns the bytes
// moved (fewer than len only when a read hits the end of the file) or -errno. A filesystem that
// accepted O_DIRECT at open but refuses the transfer (EINVAL) gets the rest buffered.
int64_t transfer(int fd, bool write, uint8_t* buf, uint64_t len, uint64_t off, bool* direct) {
  uint64_t done = 0;
  while (done < len) {
    const ssize_t n = write ? ::pwrite(fd, buf + done, len - done, static_cast<off_t>(off + done))
                            : ::pread(fd, buf + done, len - done, static_cast<off_t>(off + done));
    if (n < 0) {
      const int e = errno;
      if (e == EINTR) continue;
      if (e == EINVAL && *direct) {
        const int flags = ::fcntl(fd, F_GETFL);
        if (flags >= 0 && ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) == 0) {
          *direct = false;
          continue;
        }
      }
      return -e;
    }
    if (n == 0) {
      if (write) return -EIO;  // a write that makes no progress would loop forever
      break;
    }
    done += static_cast<uint64_t>(n);
  }
  return static_cast<int64_t>(done);
}

// Opens with O_DIRECT when asked and the filesystem allows it (some refuse it with EINVAL, e.g.
// tmpfs before Linux 6.6).
int open_maybe_direct(const std::string& path, int flags, bool* direct) {
  for (;;) {
    const int fd = ::open(path.c_str(), flags | O_CLOEXEC | (*direct ? O_DIRECT : 0), 0644);
    if (fd >= 0 || errno != EINVAL || !*direct) return fd;
    *direct = false;
  }
}

bool direct_ok(uintptr_t ptr, uint64_t bytes) { return ptr % kAlign == 0 && bytes % kAlign == 0; }

std::atomic<uint64_t> g_tmp_counter{0};

int checked_threads(int n) {
  LMC_CHECK_ARG(n >= 1 && n <= 1024, "io_threads must be in [1, 1024], got ", n);
  return n;
}

}  // namespace

DiskStore::DiskStore(const std::string& path, uint64_t capacity_bytes, int io_threads)
    : root_(path), capacity_(capacity_bytes), pool_(checked_threads(io_threads)), read_pool_(io_threads) {
  LMC_CHECK_ARG(!path.empty(), "DiskStore needs a directory path");
  struct stat sb;
  if (::stat(path.c_str(), &sb) != 0) {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) throw std::runtime_error(concat("DiskStore: cannot create directory ", path, ": ", ec.message()));
    if (::stat(path.c_str(), &sb) != 0)
      throw std::runtime_error(concat("DiskStore: cannot stat ", path, ": ", errno_text(errno)));
  }
  if (!S_ISDIR(sb.st_mode)) throw std::runtime_error(concat("DiskStore: ", path, " exists and is not a directory"));
  if (::access(path.c_str(), R_OK | W_OK | X_OK) != 0)
    throw std::runtime_error(concat("DiskStore: directory ", path, " is not usable: ", errno_text(errno)));
  st_.capacity = capacity_;
  scan();
}

std::string DiskStore::name_of(const std::string& key) {
  static const char digits[] = "0123456789abcdef";
  std::string name(32, '0');
  for (int half = 0; half < 2; ++half) {
    const uint64_t h = xxh64(key.data(), key.size(), half);
    for (int i = 0; i < 16; ++i) name[half * 16 + i] = digits[(h >> (60 - 4 * i)) & 0xf];
  }
  return name;
}

std::string DiskStore::file_path(const std::string& name) const {
  return concat(root_, "/", name.substr(0, 2), "/", name, ".kv");
}

std::mutex& DiskStore::name_lock(const std::string& name) {
  // The name is already a hash: its last two hex digits spread evenly.
  auto hex = [](char c) { return static_cast<size_t>(c <= '9' ? c - '0' : c - 'a' + 10); };
  return name_locks_[(hex(name[30]) * 16 + hex(name[31])) % name_locks_.size()];
}

void DiskStore::record_error(const std::string& msg, int64_t DiskStoreStats::*counter) {
  std::lock_guard<std::mutex> lk(mu_);
  if (counter) ++(st_.*counter);
  st_.last_error = msg;
}

// ---- index ---------------------------------------------------------------------------------

void DiskStore::insert_locked(const std::string& key, uint64_t payload_bytes, const std::string& format) {
  auto it = index_.find(key);
  if (it != index_.end()) erase_locked(it);
  Entry e;
  e.payload_bytes = payload_bytes;
  e.format = format;
  e.gen = next_gen_++;
  e.lru = lru_.insert(lru_.end(), key);
  index_.emplace(key, std::move(e));
  used_ += kHdr + payload_bytes;
}

void DiskStore::erase_locked(std::unordered_map<std::string, Entry>::iterator it) {
  used_ -= kHdr + it->second.payload_bytes;
  lru_.erase(it->second.lru);
  index_.erase(it);
}

void DiskStore::make_room_locked(uint64_t need, std::vector<Victim>* victims) {
  while (used_ + reserved_ + need > capacity_) {
    auto it = index_.find(lru_.front());
    victims->push_back({it->first, name_of(it->first)});
    erase_locked(it);
    ++st_.evictions;
  }
}

void DiskStore::unlink_victims(const std::vector<Victim>& victims) {
  for (const Victim& v : victims) {
    std::lock_guard<std::mutex> nl(name_lock(v.name));
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (index_.count(v.key)) continue;  // put again since: the file is the new one
    }
    const std::string p = file_path(v.name);
    if (::unlink(p.c_str()) != 0 && errno != ENOENT)
      record_error(concat("evict: unlink ", p, ": ", errno_text(errno)), &DiskStoreStats::errors);
  }
}

// ---- put -----------------------------------------------------------------------------------

std::vector<uint8_t> DiskStore::put(const std::vector<PutItem>& items) {
  std::vector<uint8_t> ok(items.size(), 0);
  pool_.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) { ok[i] = put_one(items[i]) ? 1 : 0; });
  return ok;
}

bool DiskStore::put_one(const PutItem& item) {
  const std::string name = name_of(item.key);
  const std::string final_path = file_path(name);
  if (item.key.size() + item.format.size() > kHdr - kFixedFields) {
    record_error(concat("put ", final_path, ": key and format (", item.key.size() + item.format.size(),
                        " bytes) do not fit the header"),
                 &DiskStoreStats::rejected);
    return false;
  }
  const uint64_t bytes = kHdr + item.size;
  std::vector<Victim> victims;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (bytes > capacity_) {
      ++st_.rejected;
      st_.last_error = concat("put ", final_path, ": ", bytes, " bytes exceed the capacity of ", capacity_, " bytes");
      return false;
    }
    // Files in the index can always be evicted, but bytes reserved by puts in flight cannot:
    // wait for those to land (they always finish) rather than fail an item that fits.
    room_cv_.wait(lk, [&] { return reserved_ + bytes <= capacity_; });
    make_room_locked(bytes, &victims);
    // Held until the file is in the index (or the put failed), so concurrent puts cannot
    // overshoot the capacity between their eviction and their insert.
    reserved_ += bytes;
  }
  unlink_victims(victims);

  const auto t0 = Clock::now();
  const std::string tmp = concat(final_path, ".tmp.", static_cast<long long>(::getpid()), ".",
                                 g_tmp_counter.fetch_add(1, std::memory_order_relaxed));
  std::string err;
  bool direct = direct_ok(item.ptr, item.size);
  Fd fd(open_maybe_direct(tmp, O_WRONLY | O_CREAT | O_EXCL, &direct));
  int open_errno = fd.get() < 0 ? errno : 0;
  if (open_errno == ENOENT) {  // the first file of its subdirectory
    const std::string dir = concat(root_, "/", name.substr(0, 2));
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      err = concat("put: mkdir ", dir, ": ", errno_text(errno));
    } else {
      fd.reset(open_maybe_direct(tmp, O_WRONLY | O_CREAT | O_EXCL, &direct));
      open_errno = fd.get() < 0 ? errno : 0;
    }
  }
  if (err.empty() && open_errno != 0) err = concat("put: open ", tmp, ": ", errno_text(open_errno));

  // The payload goes first, hashed piece by piece just before each piece is written; the header,
  // which carries the checksum, last. Nobody sees the file before the rename.
  uint8_t* src = reinterpret_cast<uint8_t*>(item.ptr);
  Xxh64 hash(0);
  const uint64_t piece = direct ? kDirectPiece : kBufferedPiece;
  for (uint64_t done = 0; err.empty() && done < item.size; done += piece) {
    const uint64_t n = std::min(piece, item.size - done);
    hash.update(src + done, n);
    const int64_t r = transfer(fd.get(), true, src + done, n, kHdr + done, &direct);
    if (r < 0) err = concat("put: write ", tmp, ": ", errno_text(static_cast<int>(-r)));
  }
  if (err.empty()) {
    AlignedBuf hdr;  // aligned for O_DIRECT
    if (!hdr.alloc(kHdr)) {
      err = concat("put ", final_path, ": no memory for a header buffer");
    } else {
      encode_header(hdr.data(), item.key, item.format, item.size, hash.digest());
      const int64_t r = transfer(fd.get(), true, hdr.data(), kHdr, 0, &direct);
      if (r < 0) err = concat("put: write ", tmp, ": ", errno_text(static_cast<int>(-r)));
    }
  }
  if (err.empty()) {
    if (const int e = fd.close()) err = concat("put: close ", tmp, ": ", errno_text(e));
  }
  fd.reset();

  if (err.empty()) {
    std::lock_guard<std::mutex> nl(name_lock(name));
    if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
      err = concat("put: rename ", tmp, " -> ", final_path, ": ", errno_text(errno));
    } else {
      {
        std::lock_guard<std::mutex> lk(mu_);
        reserved_ -= bytes;
        insert_locked(item.key, item.size, item.format);
        ++st_.writes;
        st_.write_bytes += item.size;
        st_.write_seconds += seconds_since(t0);
        ++(direct ? st_.direct_writes : st_.buffered_writes);
      }
      room_cv_.notify_all();
      return true;
    }
  }
  ::unlink(tmp.c_str());  // fails harmlessly if the open never created it
  {
    std::lock_guard<std::mutex> lk(mu_);
    reserved_ -= bytes;
    ++st_.errors;
    st_.last_error = err;
  }
  room_cv_.notify_all();
  return false;
}

// ---- get -----------------------------------------------------------------------------------

std::vector<int64_t> DiskStore::get(const std::vector<GetItem>& items) {
  std::vector<int64_t> out(items.size(), kMiss);
  read_pool_.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) { out[i] = get_one(items[i]); });
  return out;
}

int64_t DiskStore::get_one(const GetItem& item) {
  // A retry means a put replaced the object between the index lookup and the open; a few
  // attempts settle it unless the key is rewritten nonstop, which reads as a miss.
  for (int attempt = 0; attempt < 4; ++attempt) {
    int64_t result = kMiss;
    if (get_attempt(item, &result) == Outcome::kDone) return result;
  }
  return kMiss;
}

DiskStore::Drop DiskStore::drop_if_current(const std::string& key, const std::string& name, uint64_t gen,
                                           bool unlink_file) {
  std::lock_guard<std::mutex> nl(name_lock(name));
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return Drop::kGone;
    if (it->second.gen != gen) return Drop::kReplaced;
    erase_locked(it);
  }
  if (unlink_file) ::unlink(file_path(name).c_str());
  return Drop::kDropped;
}

DiskStore::Outcome DiskStore::get_attempt(const GetItem& item, int64_t* result) {
  uint64_t payload = 0, gen = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(item.key);
    if (it == index_.end()) {
      *result = kMiss;
      return Outcome::kDone;
    }
    const Entry& e = it->second;
    if (e.format != item.format) {
      *result = kWrongFormat;
      return Outcome::kDone;
    }
    if (e.payload_bytes > item.capacity) {
      *result = kTooSmall;
      return Outcome::kDone;
    }
    payload = e.payload_bytes;
    gen = e.gen;
  }
  const std::string name = name_of(item.key);
  const std::string path = file_path(name);
  const auto t0 = Clock::now();
  bool direct = direct_ok(item.ptr, payload);
  Fd fd(open_maybe_direct(path, O_RDONLY, &direct));

  auto io_error = [&](const std::string& what, int e) {
    record_error(concat("get: ", what, " ", path, ": ", errno_text(e)), &DiskStoreStats::errors);
    *result = kIoError;
    return Outcome::kDone;
  };
  // `mismatch`: a valid header that disagrees with the index, which a put racing this read
  // explains unless the entry is still the one looked up.
  auto corrupt = [&](const std::string& why, bool mismatch) {
    fd.reset();
    switch (drop_if_current(item.key, name, gen, true)) {
      case Drop::kReplaced:
        return Outcome::kRetry;
      case Drop::kGone:
        if (mismatch) {
          *result = kMiss;
          return Outcome::kDone;
        }
        break;
      case Drop::kDropped:
        break;
    }
    record_error(concat("get ", path, ": corrupt (", why, "), dropped"), &DiskStoreStats::corrupt);
    *result = kCorrupt;
    return Outcome::kDone;
  };
  // A medium error means the bytes are lost: the object is as good as corrupt.
  auto failed = [&](const std::string& what, int64_t r) {
    const int e = static_cast<int>(-r);
    return e == EIO || e == EBADMSG ? corrupt(concat(what, ": ", errno_text(e)), false) : io_error(what, e);
  };

  if (fd.get() < 0) {
    const int e = errno;
    if (e != ENOENT) return io_error("open", e);
    // Evicted or replaced since the lookup, or deleted behind the store's back.
    if (drop_if_current(item.key, name, gen, false) == Drop::kReplaced) return Outcome::kRetry;
    *result = kMiss;
    return Outcome::kDone;
  }

  AlignedBuf hdr;  // aligned for O_DIRECT
  if (!hdr.alloc(kHdr)) return io_error("header buffer for", ENOMEM);
  int64_t r = transfer(fd.get(), false, hdr.data(), kHdr, 0, &direct);
  if (r < 0) return failed("read header", r);
  if (static_cast<uint64_t>(r) < kHdr) return corrupt("file shorter than a header", false);
  Header h;
  const std::string why = decode_header(hdr.data(), &h);
  if (!why.empty()) return corrupt(why, false);
  if (h.payload_bytes != payload || h.key != item.key || h.format != item.format)
    return corrupt("header does not match the index", true);

  uint8_t* dst = reinterpret_cast<uint8_t*>(item.ptr);
  Xxh64 hash(0);
  const uint64_t piece = direct ? kDirectPiece : kBufferedPiece;
  for (uint64_t done = 0; done < payload; done += piece) {
    const uint64_t n = std::min(piece, payload - done);
    r = transfer(fd.get(), false, dst + done, n, kHdr + done, &direct);
    if (r < 0) return failed("read payload", r);
    if (static_cast<uint64_t>(r) < n) return corrupt("file shorter than its header says", false);
    hash.update(dst + done, n);
  }
  if (hash.digest() != h.payload_checksum) return corrupt("payload checksum mismatch", false);
  fd.reset();

  std::lock_guard<std::mutex> lk(mu_);
  auto it = index_.find(item.key);
  if (it != index_.end() && it->second.gen == gen) lru_.splice(lru_.end(), lru_, it->second.lru);
  ++st_.reads;
  st_.read_bytes += payload;
  st_.read_seconds += seconds_since(t0);
  ++(direct ? st_.direct_reads : st_.buffered_reads);
  *result = static_cast<int64_t>(payload);
  return Outcome::kDone;
}

// ---- lookup, remove, stats ------------------------------------------------------------------

std::vector<std::optional<std::pair<uint64_t, std::string>>> DiskStore::lookup(
    const std::vector<std::string>& keys) const {
  std::vector<std::optional<std::pair<uint64_t, std::string>>> out(keys.size());
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = index_.find(keys[i]);
    if (it != index_.end()) out[i].emplace(it->second.payload_bytes, it->second.format);
  }
  return out;
}

int64_t DiskStore::remove(const std::vector<std::string>& keys) {
  int64_t removed = 0;
  for (const std::string& key : keys) {
    const std::string name = name_of(key);
    std::lock_guard<std::mutex> nl(name_lock(name));
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = index_.find(key);
      if (it == index_.end()) continue;
      erase_locked(it);
    }
    ++removed;
    const std::string p = file_path(name);
    if (::unlink(p.c_str()) != 0 && errno != ENOENT)
      record_error(concat("remove: unlink ", p, ": ", errno_text(errno)), &DiskStoreStats::errors);
  }
  return removed;
}

std::vector<std::pair<std::string, uint64_t>> DiskStore::entries() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::pair<std::string, uint64_t>> out;
  out.reserve(lru_.size());
  for (const std::string& key : lru_) out.emplace_back(key, index_.at(key).payload_bytes);
  return out;
}

DiskStoreStats DiskStore::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  DiskStoreStats s = st_;
  s.bytes_used = used_;
  s.objects = static_cast<int64_t>(index_.size());
  return s;
}

// ---- start-up scan ---------------------------------------------------------------------------

void DiskStore::scan() {
  const auto t0 = Clock::now();
  DIR* top = ::opendir(root_.c_str());
  if (!top) throw std::runtime_error(concat("DiskStore: cannot list ", root_, ": ", errno_text(errno)));
  std::vector<std::string> subdirs;
  while (const dirent* d = ::readdir(top)) {
    if (std::strlen(d->d_name) == 2 && is_lower_hex(d->d_name, 2)) subdirs.emplace_back(d->d_name);
  }
  ::closedir(top);
  std::sort(subdirs.begin(), subdirs.end());

  struct Candidate {
    std::string dir, name;  // <dir>/<name>.kv
    bool valid = false, unreadable = false;
    Header h;
    struct timespec mtime = {};
  };
  std::vector<Candidate> cands;
  std::vector<std::string> leftovers;  // temp files of writes a crash interrupted
  for (const std::string& sub : subdirs) {
    const std::string dir = concat(root_, "/", sub);
    DIR* dd = ::opendir(dir.c_str());
    if (!dd) continue;  // not a directory: not ours
    while (const dirent* d = ::readdir(dd)) {
      const std::string f = d->d_name;
      if (f.find(".tmp") != std::string::npos) {
        leftovers.push_back(concat(dir, "/", f));
      } else if (f.size() == 35 && f.compare(32, 3, ".kv") == 0 && is_lower_hex(f.data(), 32)) {
        cands.emplace_back();
        cands.back().dir = sub;
        cands.back().name = f.substr(0, 32);
      }
    }
    ::closedir(dd);
  }
  int64_t dropped = 0;
  for (const std::string& p : leftovers) dropped += ::unlink(p.c_str()) == 0 ? 1 : 0;

  // Headers only (the payload checksum is checked on every read); many at once, since a cold
  // scan of a large directory waits on the disk.
  pool_.parallel_for(static_cast<int64_t>(cands.size()), [&](int64_t i) {
    Candidate& c = cands[i];
    const std::string p = concat(root_, "/", c.dir, "/", c.name, ".kv");
    Fd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
      // Not provably bad (e.g. out of descriptors): leave it on disk, outside the index.
      const int e = errno;
      c.unreadable = e != ENOENT;
      if (c.unreadable) record_error(concat("scan: open ", p, ": ", errno_text(e)), &DiskStoreStats::errors);
      return;
    }
    struct stat sb;
    if (::fstat(fd.get(), &sb) != 0 || !S_ISREG(sb.st_mode)) return;
    uint8_t hdr[kHdr];
    bool direct = false;
    if (transfer(fd.get(), false, hdr, kHdr, 0, &direct) != static_cast<int64_t>(kHdr)) return;
    if (!decode_header(hdr, &c.h).empty()) return;
    if (static_cast<uint64_t>(sb.st_size) != kHdr + c.h.payload_bytes) return;
    if (c.dir != c.name.substr(0, 2) || name_of(c.h.key) != c.name) return;
    c.mtime = sb.st_mtim;
    c.valid = true;
  });

  std::vector<Candidate*> valid;
  for (Candidate& c : cands) {
    if (c.valid) {
      valid.push_back(&c);
    } else if (!c.unreadable) {
      const std::string p = concat(root_, "/", c.dir, "/", c.name, ".kv");
      dropped += ::unlink(p.c_str()) == 0 ? 1 : 0;
    }
  }
  // Least recently written first: the LRU order a restart can recover.
  std::sort(valid.begin(), valid.end(), [](const Candidate* a, const Candidate* b) {
    return std::tie(a->mtime.tv_sec, a->mtime.tv_nsec, a->name) < std::tie(b->mtime.tv_sec, b->mtime.tv_nsec, b->name);
  });
  std::vector<std::string> over;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const Candidate* c : valid) insert_locked(c->h.key, c->h.payload_bytes, c->h.format);
    while (used_ > capacity_) {  // the capacity shrank since the last run
      auto it = index_.find(lru_.front());
      over.push_back(file_path(name_of(it->first)));
      erase_locked(it);
      ++st_.evictions;
    }
    st_.dropped_at_scan = dropped;
  }
  for (const std::string& p : over) ::unlink(p.c_str());
  std::lock_guard<std::mutex> lk(mu_);
  st_.scan_seconds = seconds_since(t0);
}

}  // namespace lmc
