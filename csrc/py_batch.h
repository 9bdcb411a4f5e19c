// Turning Python arguments (NumPy arrays) into a ChunkBatch; shared by the binding files.
#pragma once

#include <pybind11/numpy.h>

#include "common.h"
#include "kv_layout.h"

namespace lmc {

using IdArray = pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>;
using PtrArray = pybind11::array_t<uint64_t, pybind11::array::c_style | pybind11::array::forcecast>;

// The arrays must outlive the batch (it points into them).
inline ChunkBatch make_batch(const IdArray& ids, const PtrArray& ptrs, int64_t chunk_size, int64_t object_capacity) {
  LMC_CHECK_ARG(ids.ndim() == 1 && ptrs.ndim() == 1, "block_ids and object_ptrs must be 1-D");
  ChunkBatch b;
  b.block_ids = ids.data();
  b.num_block_ids = ids.shape(0);
  b.object_ptrs = ptrs.data();
  b.num_chunks = ptrs.shape(0);
  b.chunk_size = chunk_size;
  b.object_capacity = object_capacity;
  return b;
}

}  // namespace lmc
