// pybind11 bindings of the torch-free data plane. Everything takes raw addresses and sizes.
#include <cstring>
#include <string_view>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "cpu_transfer.h"
#include "host_arena.h"
#include "kv_layout.h"
#include "pinned_memory.h"
#include "py_batch.h"
#include "spin_poll.h"
#include "thread_pool.h"

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
      .def_property_readonly("num_layers", &KVLayout::num_layers)
      .def_property_readonly("token_bytes", &KVLayout::token_bytes)
      .def_property_readonly("layer_extent", &KVLayout::layer_extent)
      .def("object_bytes", &KVLayout::object_bytes, py::arg("chunk_size"))
      .def("validate", &KVLayout::validate);

  py::class_<HostArena>(m, "HostArena")
      .def(py::init<uint64_t, uint64_t, bool, int>(), py::arg("capacity"), py::arg("slab_bytes"),
           py::arg("pin") = false, py::arg("numa_node") = -1)
      .def_property_readonly("base", &HostArena::base)
      .def_property_readonly("capacity", &HostArena::capacity)
      .def_property_readonly("slab_bytes", &HostArena::slab_bytes)
      .def_property_readonly("fd", &HostArena::fd)
      .def("size_class", &HostArena::size_class, py::arg("object_bytes"))
      .def("slot_bytes", &HostArena::slot_bytes, py::arg("size_class"))
      .def("allocate", &HostArena::allocate, py::arg("size_class"))
      .def("free", &HostArena::free, py::arg("offset"))
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
             for (const ClassStats& c : a.class_stats()) {
               py::dict d;
               d["object_bytes"] = c.object_bytes;
               d["slot_bytes"] = c.slot_bytes;
               d["slots_per_slab"] = c.slots_per_slab;
               d["slabs"] = c.slabs;
               d["objects"] = c.objects;
               d["free_slots"] = c.free_slots;
               out.append(d);
             }
             return out;
           })
      .def("stats",
           [](const HostArena& a) {
             ArenaStats s = a.stats();
             py::dict d;
             d["capacity"] = s.capacity;
             d["slab_bytes"] = s.slab_bytes;
             d["num_slabs"] = s.num_slabs;
             d["free_slabs"] = s.free_slabs;
             d["pending_slabs"] = s.pending_slabs;
             d["failed_slabs"] = s.failed_slabs;
             d["bytes_allocated"] = s.bytes_allocated;
             d["objects"] = s.objects;
             return d;
           })
      .def("pin_status",
           [](const HostArena& a) {
             PinStatus p = a.pin_status();
             py::dict d;
             d["requested"] = p.requested;
             d["done"] = p.done;
             d["bytes_pinned"] = p.bytes_pinned;
             d["bytes_total"] = p.bytes_total;
             d["seconds"] = p.seconds;
             d["error"] = p.error;
             return d;
           })
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
