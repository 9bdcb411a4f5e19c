// pybind11 bindings of the CUDA data plane (submodule _C.cuda).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "cuda/cuda_runtime.h"
#include "cuda/transfer_engine.h"
#include "pinned_memory.h"
#include "py_batch.h"

namespace py = pybind11;

namespace lmc::cuda {
namespace {

Direction parse_direction(const std::string& d) {
  if (d == "gather" || d == "store") return Direction::kGather;
  if (d == "scatter" || d == "retrieve") return Direction::kScatter;
  throw InvalidArgument(concat("direction must be 'gather' or 'scatter', got '", d, "'"));
}

Mode parse_mode(const std::string& m) {
  if (m == "direct") return Mode::kDirect;
  if (m == "staged") return Mode::kStaged;
  if (m == "dma") return Mode::kDma;
  if (m == "segment_loop") return Mode::kSegmentLoop;
  if (m == "batch_uncoalesced") return Mode::kBatchUncoalesced;
  if (m == "single_buffer") return Mode::kSingleBuffer;
  throw InvalidArgument(concat("unknown transfer mode '", m, "'"));
}

// Destroying an engine synchronises its streams and frees device memory: without the GIL.
struct ReleaseGilDelete {
  void operator()(TransferEngine* e) const {
    py::gil_scoped_release nogil;
    delete e;
  }
};

}  // namespace
}  // namespace lmc::cuda

void init_cuda_bindings(py::module_& m) {
  using namespace lmc;
  using namespace lmc::cuda;
  py::module_ c = m.def_submodule("cuda", "CUDA runtime helpers and the GPU transfer engine");
  // Every call that may wait in the driver releases the GIL: the driver is busy for long stretches
  // (cudaHostRegister of a slab while the arena pins), and the socket thread must keep answering.
  c.def("device_count", &device_count, "Visible CUDA devices (0 without driver or device)");
  c.def(
      "device_uuid",
      [](int d) {
        std::string u;
        {
          py::gil_scoped_release nogil;
          u = device_uuid(d);
        }
        return py::bytes(u);
      },
      py::arg("device"));
  c.def("device_name", &device_name, py::arg("device"));
  c.def("device_pci_bus_id", &device_pci_bus_id, py::arg("device"));
  c.def("device_by_uuid", [](const py::bytes& u) { return device_by_uuid(u); }, py::arg("uuid"));
  c.def("driver_version", &driver_version);
  c.def("runtime_version", &runtime_version);

  c.def(
      "export_memory",
      [](uintptr_t ptr) {
        MemoryExport e;
        {
          py::gil_scoped_release nogil;
          e = export_memory(ptr);
        }
        return py::make_tuple(py::bytes(e.handle), e.offset, e.alloc_bytes, e.device);
      },
      py::arg("ptr"), "(handle, offset in allocation, allocation bytes, device) of a device pointer");
  c.def("address_range", [](uintptr_t p, int d) { return address_range(p, d); }, py::arg("ptr"),
        py::arg("device") = -1, py::call_guard<py::gil_scoped_release>(),
        "(base, bytes) of the device allocation holding an address");
  c.def(
      "open_memory",
      [](const py::bytes& h, int d) {
        std::string handle = h;
        py::gil_scoped_release nogil;
        return open_memory(handle, d);
      },
      py::arg("handle"), py::arg("device"), "Map another process's allocation; returns its base address");
  c.def("close_memory", &close_memory, py::arg("base"), py::arg("device"), py::call_guard<py::gil_scoped_release>());

  c.def("create_event", &create_event, py::arg("device"), py::arg("interprocess") = true,
        py::arg("blocking") = false, py::call_guard<py::gil_scoped_release>());
  c.def("destroy_event", &destroy_event, py::arg("event"), py::call_guard<py::gil_scoped_release>());
  c.def("event_ipc_handle", [](uintptr_t e) { return py::bytes(event_ipc_handle(e)); }, py::arg("event"));
  c.def(
      "open_event",
      [](const py::bytes& h, int d) {
        std::string handle = h;
        py::gil_scoped_release nogil;
        return open_event(handle, d);
      },
      py::arg("handle"), py::arg("device"));
  // Only enqueued on a stream, and on the client's hot path: these keep the GIL.
  c.def("record_event", &record_event, py::arg("event"), py::arg("stream"));
  c.def("stream_wait_event", &stream_wait_event, py::arg("stream"), py::arg("event"));
  c.def("event_synchronize", &event_synchronize, py::arg("event"), py::call_guard<py::gil_scoped_release>());
  c.def("event_query", &event_query, py::arg("event"));
  c.def("stream_query", &stream_query, py::arg("stream"));
  c.def("create_stream", &create_stream, py::arg("device"), py::arg("high_priority") = false, py::call_guard<py::gil_scoped_release>());
  c.def("destroy_stream", &destroy_stream, py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  c.def("stream_synchronize", &stream_synchronize, py::arg("stream"), py::call_guard<py::gil_scoped_release>());

  // Host memory another process allocated (the server's arena, mapped here) page-locked for this
  // process's copies: an engine that moves its KV itself.
  // The device is made current first: a thread with none would create a context on device 0.
  c.def(
      "host_register",
      [](uintptr_t ptr, uint64_t bytes, int device) {
        std::string error;
        bool ok;
        {
          py::gil_scoped_release nogil;
          DeviceGuard g(device);
          ok = pin_host_memory(reinterpret_cast<void*>(ptr), bytes, &error);
        }
        if (!ok) throw std::runtime_error(error);
      },
      py::arg("ptr"), py::arg("bytes"), py::arg("device"),
      "Page-lock [ptr, ptr + bytes) for this process's copies (cudaHostRegister)");
  c.def(
      "host_unregister",
      [](uintptr_t ptr, int device) {
        DeviceGuard g(device);
        unpin_host_memory(reinterpret_cast<void*>(ptr));
      },
      py::arg("ptr"), py::arg("device"), py::call_guard<py::gil_scoped_release>());

  py::class_<TransferEngine, std::unique_ptr<TransferEngine, ReleaseGilDelete>>(c, "TransferEngine")
      .def(py::init([](int device, const KVLayout& layout, int64_t chunk_size, int64_t staging_bytes, int direct_ctas,
                       int pack_ctas, int threads, bool blocking_sync, bool high_priority) {
             EngineOptions o;
             o.staging_bytes = staging_bytes;
             o.direct_ctas = direct_ctas;
             o.pack_ctas = pack_ctas;
             o.threads = threads;
             o.blocking_sync = blocking_sync;
             o.high_priority = high_priority;
             py::gil_scoped_release nogil;  // allocates the staging ring and streams: driver work
             return new TransferEngine(device, layout, chunk_size, o);
           }),
           py::arg("device"), py::arg("layout"), py::arg("chunk_size"), py::arg("staging_bytes") = 256ll << 20,
           py::arg("direct_ctas") = 4, py::arg("pack_ctas") = 0, py::arg("threads") = 1024,
           py::arg("blocking_sync") = false, py::arg("high_priority") = true)
      .def(
          "submit",
          [](TransferEngine& e, const std::string& direction, const std::string& mode, const IdArray& ids,
             const PtrArray& ptrs, int64_t chunk_size, int64_t object_capacity, uintptr_t wait_event,
             bool with_handle, uintptr_t then_stream) -> py::object {
            const ChunkBatch b = make_batch(ids, ptrs, chunk_size, object_capacity);
            const Direction d = parse_direction(direction);
            const Mode md = parse_mode(mode);
            e.validate(md, b);  // bad requests fail here, with the GIL held, before anything is queued
            std::string handle;
            uint64_t ticket;
            {
              py::gil_scoped_release nogil;
              ticket = e.submit(d, md, b, wait_event, with_handle ? &handle : nullptr, then_stream);
            }
            if (!with_handle) return py::int_(ticket);
            return py::make_tuple(ticket, py::bytes(handle));
          },
          py::arg("direction"), py::arg("mode"), py::arg("block_ids"), py::arg("object_ptrs"), py::arg("chunk_size"),
          py::arg("object_capacity"), py::arg("wait_event") = 0, py::arg("with_handle") = false,
          py::arg("then_stream") = 0,
          "the transfer's ticket; (ticket, completion event's IPC handle) with with_handle; then_stream (a "
          "stream of this process) is made to wait for the transfer")
      .def("wait", &TransferEngine::wait, py::arg("ticket"), py::call_guard<py::gil_scoped_release>())
      .def(
          "wait_next",
          [](TransferEngine& e, const std::string& direction, int64_t spin_us) {
            const Direction d = parse_direction(direction);
            TransferEngine::Completion c;
            {
              py::gil_scoped_release nogil;
              c = e.wait_next(d, spin_us);
            }
            return py::make_tuple(c.ticket, c.done_ns, c.error);
          },
          py::arg("direction"), py::arg("spin_us") = 0,
          "(ticket, CLOCK_MONOTONIC ns when seen done, error or '') of the direction's oldest transfer; "
          "ticket 0 once stop_waiting() was called and none is left")
      .def("stop_waiting", &TransferEngine::stop_waiting, py::call_guard<py::gil_scoped_release>())
      .def("query", &TransferEngine::query, py::arg("ticket"))
      .def_property_readonly("device", &TransferEngine::device)
      .def_property_readonly("direct_supported", &TransferEngine::direct_supported)
      .def("stats", [](const TransferEngine& e) {
        const EngineStats s = e.stats();
        py::dict d;
        LMC_ENGINE_STATS(LMC_DICT_FIELD)
        return d;
      });
}
