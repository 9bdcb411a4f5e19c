// pybind11 bindings of the torch-free data plane. Everything takes raw addresses and sizes.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "cpu_transfer.h"
#include "disk_store.h"
#include "host_arena.h"
#include "kv_codec.h"
#include "kv_layout.h"
#include "pinned_memory.h"
#include "py_batch.h"
#include "spin_poll.h"
#include "thread_pool.h"
#include "xxhash64.h"

namespace py = pybind11;

#ifdef LMC_WITH_CUDA
void init_cuda_bindings(py::module_& m);
#endif

namespace lmc {
namespace {

void cpu_copy(const KVLayout& layout, int64_t chunk_size, const IdArray& ids, const PtrArray& ptrs,
              int64_t object_capacity, Direction dir) {
  ChunkBatch b = make_batch(ids, ptrs, chunk_size, object_capacity);
  py::gil_scoped_release nogil;
  cpu_transfer(layout, b, dir);
}

// The block ids of a request (packed little-endian int32), checked and widened in one call: the
// [chunks, per_chunk] int64 array, or InvalidArgument naming the first problem.
py::array_t<int64_t> request_block_ids(const py::bytes& packed, int64_t chunks, int64_t per_chunk, int64_t num_blocks,
                                       bool distinct) {
  const std::string_view data = packed;
  LMC_CHECK_ARG(data.size() % 4 == 0, "block ids must be packed int32, got ", data.size(), " bytes");
  const int64_t n = static_cast<int64_t>(data.size() / 4);
  LMC_CHECK_ARG(n == chunks * per_chunk, chunks, " chunks need ", chunks * per_chunk, " block ids, got ", n);
  py::array_t<int64_t> out({chunks, per_chunk});
  int64_t* ids = out.mutable_data();
  std::vector<uint64_t> seen(distinct ? (num_blocks + 63) / 64 : 0);
  for (int64_t i = 0; i < n; ++i) {
    int32_t v;
    std::memcpy(&v, data.data() + 4 * i, 4);  // little-endian hosts only (x86-64, aarch64)
    LMC_CHECK_ARG(v >= 0 && v < num_blocks, "block id ", v, " is out of range [0, ", num_blocks, ")");
    if (distinct) {
      uint64_t& word = seen[v / 64];
      const uint64_t bit = uint64_t{1} << (v % 64);
      LMC_CHECK_ARG(!(word & bit), "block id ", v, " appears twice (two chunks cannot fill one block)");
      word |= bit;
    }
    ids[i] = v;
  }
  return out;
}

// Messages may quote paths; a byte that is not UTF-8 must not turn stats() into an exception.
py::str lossy_str(const std::string& s) {
  return py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
}

void check_batch(const char* fn, size_t keys, size_t formats, size_t ptrs, size_t sizes, const char* sizes_name) {
  LMC_CHECK_ARG(formats == keys && ptrs == keys && sizes == keys, "DiskStore.", fn, ": keys, formats, ptrs and ",
                sizes_name, " must have equal lengths, got ", keys, ", ", formats, ", ", ptrs, " and ", sizes);
}

template <typename Item>
std::vector<Item> disk_items(const char* fn, const std::vector<py::bytes>& keys, const std::vector<py::bytes>& formats,
                             const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& sizes,
                             const char* sizes_name) {
  check_batch(fn, keys.size(), formats.size(), ptrs.size(), sizes.size(), sizes_name);
  std::vector<Item> items(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    LMC_CHECK_ARG(sizes[i] >= 0, "DiskStore.", fn, ": ", sizes_name, "[", i, "] is negative (", sizes[i], ")");
    LMC_CHECK_ARG(ptrs[i] != 0 || sizes[i] == 0, "DiskStore.", fn, ": ptrs[", i, "] is null");
    items[i].key = keys[i];
    items[i].format = formats[i];
    items[i].ptr = ptrs[i];
    if constexpr (std::is_same_v<Item, DiskStore::PutItem>) {
      items[i].size = static_cast<uint64_t>(sizes[i]);
    } else {
      items[i].capacity = static_cast<uint64_t>(sizes[i]);
    }
  }
  return items;
}

std::vector<std::string> disk_keys(const std::vector<py::bytes>& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

void check_codec_args(const char* fn, uintptr_t src, int64_t n, int64_t group, int dtype, uintptr_t dst) {
  LMC_CHECK_ARG(group > 0 && n >= 0 && n % group == 0, fn, ": n (", n, ") must be a multiple of group (", group,
                ")");
  LMC_CHECK_ARG(dtype == 0 || dtype == 1, fn, ": dtype must be 0 (bf16) or 1 (fp16), got ", dtype);
  LMC_CHECK_ARG((src != 0 && dst != 0) || n == 0, fn, ": null pointer");
}

py::dict disk_stats(const DiskStore& store) {
  const DiskStoreStats s = store.stats();
  py::dict d;
  LMC_DISK_STORE_STATS(LMC_DICT_FIELD)
  d["last_error"] = lossy_str(s.last_error);
  return d;
}

py::dict build_info() {
  py::dict d;
  d["version"] = LMC_VERSION;
  d["build_type"] = LMC_BUILD_TYPE;
  d["cxx_compiler"] = LMC_CXX_COMPILER;
  d["pybind11"] = std::to_string(PYBIND11_VERSION_MAJOR) + "." + std::to_string(PYBIND11_VERSION_MINOR) + "." +
                  std::to_string(PYBIND11_VERSION_PATCH);
#ifdef LMC_WITH_CUDA
  d["cuda"] = true;
  d["cuda_architectures"] = LMC_CUDA_ARCHITECTURES;
  d["cuda_compiler"] = LMC_CUDA_COMPILER;
#else
  d["cuda"] = false;
  d["cuda_architectures"] = "";
  d["cuda_compiler"] = "";
#endif
  return d;
}

}  // namespace
}  // namespace lmc

PYBIND11_MODULE(_C, m) {
  using namespace lmc;
  m.doc() = "lmcache-mp data plane (torch-free): host arena, KV layouts, CPU and CUDA transfers";
  m.attr("ARENA_SLOT_ALIGN") = kSlotAlign;
  // Translate our exceptions here, before any translator another extension (e.g. torch) put in
  // pybind11's shared registry can see them: ValueError for bad arguments, RuntimeError else.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::bad_alloc& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  m.def("build_info", &build_info, "How this extension was built");

  py::class_<KVLayout>(m, "KVLayout")
      .def(py::init<>())
      .def_readwrite("layer_ptrs", &KVLayout::layer_ptrs)
      .def_readwrite("num_blocks", &KVLayout::num_blocks)
      .def_readwrite("block_size", &KVLayout::block_size)
      .def_readwrite("num_segments", &KVLayout::num_segments)
      .def_readwrite("segment_stride", &KVLayout::segment_stride)
      .def_readwrite("block_stride", &KVLayout::block_stride)
      .def_readwrite("rows_per_block", &KVLayout::rows_per_block)
      .def_readwrite("row_bytes", &KVLayout::row_bytes)
      .def_readwrite("row_stride", &KVLayout::row_stride)
      .def_readwrite("object_row_pitch", &KVLayout::object_row_pitch)
      .def_readwrite("object_row_offset", &KVLayout::object_row_offset)
      .def_property_readonly("num_layers", &KVLayout::num_layers)
      .def_property_readonly("token_bytes", &KVLayout::token_bytes)
      .def_property_readonly("layer_extent", &KVLayout::layer_extent)
      .def("object_bytes", &KVLayout::object_bytes, py::arg("chunk_size"))
      .def("validate", &KVLayout::validate);

  py::class_<HostArena>(m, "HostArena")
      .def(py::init<uint64_t, uint64_t, bool, int, const std::string&, bool>(), py::arg("capacity"),
           py::arg("slab_bytes"), py::arg("pin") = false, py::arg("numa_node") = -1, py::arg("path") = "",
           py::arg("prefault") = true)
      .def_property_readonly("reattached", &HostArena::reattached)
      .def_property_readonly("base", &HostArena::base)
      .def_property_readonly("capacity", &HostArena::capacity)
      .def_property_readonly("slab_bytes", &HostArena::slab_bytes)
      .def_property_readonly("fd", &HostArena::fd)
      .def("size_class", &HostArena::size_class, py::arg("object_bytes"))
      .def("slot_bytes", &HostArena::slot_bytes, py::arg("size_class"))
      .def("allocate", &HostArena::allocate, py::arg("size_class"))
      .def("free", &HostArena::free, py::arg("offset"))
      .def("claim", &HostArena::claim, py::arg("offset"), py::arg("size_class"))
      .def("free_slots", &HostArena::free_slots, py::arg("size_class"))
      .def("slots_per_slab", &HostArena::slots_per_slab, py::arg("size_class"))
      .def_property_readonly("num_classes", &HostArena::num_classes)
      .def("drain_candidates", &HostArena::drain_candidates, py::arg("size_class"), py::arg("max"))
      .def("slab_objects", &HostArena::slab_objects, py::arg("slab"))
      .def("drain", &HostArena::drain, py::arg("slab"))
      .def("undrain", &HostArena::undrain, py::arg("slab"))
      .def("move_objects", &HostArena::move_objects, py::arg("src"), py::arg("dst"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>(), "Copy objects to other slots (CPU copy threads, GIL released)")
      .def("class_stats",
           [](const HostArena& a) {
             py::list out;
             for (const ClassStats& s : a.class_stats()) {
               py::dict d;
               LMC_CLASS_STATS(LMC_DICT_FIELD)
               out.append(d);
             }
             return out;
           })
      .def("stats",
           [](const HostArena& a) {
             const ArenaStats s = a.stats();
             py::dict d;
             LMC_ARENA_STATS(LMC_DICT_FIELD)
             return d;
           })
      .def("pin_status",
           [](const HostArena& a) {
             const PinStatus s = a.pin_status();
             py::dict d;
             LMC_PIN_STATUS(LMC_DICT_FIELD)
             return d;
           })
      .def("release_memory", &HostArena::release_memory, py::call_guard<py::gil_scoped_release>())
      .def("pause_pinning", &HostArena::pause_pinning)
      .def("resume_pinning", &HostArena::resume_pinning)
      .def("wait_pinned", &HostArena::wait_pinned, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def(
          "view",
          [](HostArena& a, int64_t offset, int64_t nbytes) {
            LMC_CHECK_ARG(offset >= 0 && nbytes >= 0 && static_cast<uint64_t>(offset + nbytes) <= a.capacity(),
                          "view [", offset, ", ", offset + nbytes, ") is outside the arena");
            return py::memoryview::from_memory(reinterpret_cast<void*>(a.base() + offset), nbytes, false);
          },
          py::arg("offset"), py::arg("nbytes"), py::keep_alive<0, 1>(),
          "A writable memoryview of arena bytes (keeps the arena alive)");

  m.def(
      "cpu_gather",
      [](const KVLayout& l, int64_t cs, const IdArray& ids, const PtrArray& ptrs, int64_t cap) {
        cpu_copy(l, cs, ids, ptrs, cap, Direction::kGather);
      },
      py::arg("layout"), py::arg("chunk_size"), py::arg("block_ids"), py::arg("object_ptrs"),
      py::arg("object_capacity"), "Copy paged KV blocks into host objects [S, L, T, W] (GIL released)");
  m.def(
      "cpu_scatter",
      [](const KVLayout& l, int64_t cs, const IdArray& ids, const PtrArray& ptrs, int64_t cap) {
        cpu_copy(l, cs, ids, ptrs, cap, Direction::kScatter);
      },
      py::arg("layout"), py::arg("chunk_size"), py::arg("block_ids"), py::arg("object_ptrs"),
      py::arg("object_capacity"), "Copy host objects back into paged KV blocks (GIL released)");
  m.def(
      "parallel_memcpy",
      [](uintptr_t dst, uintptr_t src, size_t n) {
        py::gil_scoped_release nogil;
        parallel_memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), "Contiguous copy on the CPU copy threads (GIL released)");
  m.def(
      "_raise_for_test",
      [](int kind) -> std::string {
        if (kind == 0) throw std::invalid_argument("plain invalid_argument");
        if (kind == 1) throw InvalidArgument(concat("formatted ", 42));
        if (kind == 2) throw std::runtime_error("runtime");
        enum ProbeCode { kProbeCode = 201 };  // like a CUresult: must print as a number
        if (kind == 3) throw InvalidArgument(concat("code ", kProbeCode));
        return concat("no error ", kind);
      },
      py::arg("kind"), "Raises the C++ error `kind` (0-3): checks that errors surface as Python exceptions");
  py::class_<DiskStore>(m, "DiskStore",
                        "Local-disk object store (one file per object, LRU by bytes); I/O on its own threads")
      .def(py::init([](const py::object& path, int64_t capacity_bytes, int io_threads) {
             LMC_CHECK_ARG(capacity_bytes >= 0, "capacity_bytes must be >= 0, got ", capacity_bytes);
             const std::string p = py::module_::import("os").attr("fspath")(path).cast<std::string>();
             py::gil_scoped_release nogil;  // the scan reads every header
             return std::make_unique<DiskStore>(p, static_cast<uint64_t>(capacity_bytes), io_threads);
           }),
           py::arg("path"), py::arg("capacity_bytes"), py::arg("io_threads") = 4)
      .def(
          "put",
          [](DiskStore& s, const std::vector<py::bytes>& keys, const std::vector<py::bytes>& formats,
             const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& sizes) {
            auto items = disk_items<DiskStore::PutItem>("put", keys, formats, ptrs, sizes, "sizes");
            std::vector<uint8_t> ok;
            {
              py::gil_scoped_release nogil;
              ok = s.put(items);
            }
            py::list out;
            for (uint8_t v : ok) out.append(py::bool_(v != 0));
            return out;
          },
          py::arg("keys"), py::arg("formats"), py::arg("ptrs"), py::arg("sizes"),
          "Write objects from memory; per item True if stored (GIL released)")
      .def(
          "get",
          [](DiskStore& s, const std::vector<py::bytes>& keys, const std::vector<py::bytes>& formats,
             const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& capacities) {
            auto items = disk_items<DiskStore::GetItem>("get", keys, formats, ptrs, capacities, "capacities");
            py::gil_scoped_release nogil;
            return s.get(items);
          },
          py::arg("keys"), py::arg("formats"), py::arg("ptrs"), py::arg("capacities"),
          "Read objects into memory; per item the payload bytes, or -1 miss, -2 other format, -3 capacity too "
          "small, -4 corrupt (dropped), -5 I/O error (GIL released)")
      .def(
          "lookup",
          [](const DiskStore& s, const std::vector<py::bytes>& keys) {
            const std::vector<std::string> k = disk_keys(keys);
            std::vector<std::optional<std::pair<uint64_t, std::string>>> found;
            {
              py::gil_scoped_release nogil;
              found = s.lookup(k);
            }
            py::list out;
            for (const auto& f : found) {
              if (f) {
                out.append(py::make_tuple(f->first, py::bytes(f->second)));
              } else {
                out.append(py::none());
              }
            }
            return out;
          },
          py::arg("keys"), "Per key (payload_bytes, format) or None, from the in-memory index (no I/O)")
      .def(
          "remove",
          [](DiskStore& s, const std::vector<py::bytes>& keys) {
            const std::vector<std::string> k = disk_keys(keys);
            py::gil_scoped_release nogil;
            return s.remove(k);
          },
          py::arg("keys"), "Delete objects; returns how many were present")
      .def(
          "entries",
          [](const DiskStore& s) {
            std::vector<std::pair<std::string, uint64_t>> all;
            {
              py::gil_scoped_release nogil;
              all = s.entries();
            }
            py::list out;
            for (const auto& [key, bytes] : all) out.append(py::make_tuple(py::bytes(key), bytes));
            return out;
          },
          "(key, payload bytes) of every object, least recently used first")
      .def("stats", &disk_stats)
      .def_static(
          "name_of", [](const py::bytes& key) { return DiskStore::name_of(key); }, py::arg("key"),
          "The object's file name: XXH64(key, 0) and XXH64(key, 1) as 32 lowercase hex digits");
  m.def(
      "fp8_encode",
      [](uintptr_t src, int64_t n, int64_t group, int dtype, uintptr_t dst, bool simd) {
        check_codec_args("fp8_encode", src, n, group, dtype, dst);
        py::gil_scoped_release nogil;
        fp8_encode(reinterpret_cast<const uint16_t*>(src), static_cast<size_t>(n), static_cast<size_t>(group),
                   static_cast<KvDtype>(dtype), reinterpret_cast<uint8_t*>(dst), simd);
      },
      py::arg("src"), py::arg("n"), py::arg("group"), py::arg("dtype"), py::arg("dst"), py::arg("simd") = true,
      "n 16-bit values (dtype 0: bf16, 1: fp16) at src to FP8 E4M3 codes and one scale exponent per group of "
      "`group` at dst (fp8_encoded_bytes(n, group) bytes; GIL released); simd=False: the plain path");
  m.def(
      "fp8_decode",
      [](uintptr_t src, int64_t n, int64_t group, int dtype, uintptr_t dst, bool simd) {
        check_codec_args("fp8_decode", src, n, group, dtype, dst);
        py::gil_scoped_release nogil;
        fp8_decode(reinterpret_cast<const uint8_t*>(src), static_cast<size_t>(n), static_cast<size_t>(group),
                   static_cast<KvDtype>(dtype), reinterpret_cast<uint16_t*>(dst), simd);
      },
      py::arg("src"), py::arg("n"), py::arg("group"), py::arg("dtype"), py::arg("dst"), py::arg("simd") = true,
      "The inverse of fp8_encode: n 16-bit values at dst (GIL released)");
  m.def(
      "fp8_encoded_bytes",
      [](int64_t n, int64_t group) {
        LMC_CHECK_ARG(n >= 0 && group > 0 && n % group == 0, "fp8_encoded_bytes: n (", n,
                      ") must be a multiple of group (", group, ")");
        return fp8_encoded_bytes(static_cast<size_t>(n), static_cast<size_t>(group));
      },
      py::arg("n"), py::arg("group"));
  m.def("fp8_simd", &fp8_simd, "Whether the codec's AVX2 path runs on this CPU");
  m.def(
      "xxh64",
      [](const py::object& data, uint64_t seed) {
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
        uint64_t h;
        {
          py::gil_scoped_release nogil;
          h = xxh64(view.buf, static_cast<size_t>(view.len), seed);
        }
        PyBuffer_Release(&view);
        return h;
      },
      py::arg("data"), py::arg("seed") = 0, "XXH64 of a contiguous buffer (bytes, memoryview, NumPy array)");
  m.def("set_cpu_threads", &set_cpu_threads, py::arg("n"), "Threads for CPU copies (<= 0: one per core)");
  m.def("cpu_threads", [] { return cpu_pool()->size(); });
  m.def("pinning_available", &pinning_available);
  m.def("request_block_ids", &request_block_ids, py::arg("packed"), py::arg("chunks"), py::arg("per_chunk"),
        py::arg("num_blocks"), py::arg("distinct"),
        "Packed int32 block ids as a checked [chunks, per_chunk] int64 array (ValueError on a bad one)");
  m.def("spin_poll", &spin_poll, py::arg("fds"), py::arg("spin_us"), py::arg("timeout_ms"),
        py::call_guard<py::gil_scoped_release>(),
        "Indices of the readable fds: spin for spin_us, then sleep up to timeout_ms (< 0: no limit); [] on timeout");

#ifdef LMC_WITH_CUDA
  init_cuda_bindings(m);
#endif
}
