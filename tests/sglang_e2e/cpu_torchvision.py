"""Lets SGLang import on a CPU-only torch.

SGLang's model configs import torchvision. The registry's torchvision wheels are CUDA builds
whose C++ ops cannot load beside the CPU build of torch; torchvision's Python part then fails on
import, registering fake kernels for two ops that were never defined. Defining the two ops'
schemas first lets it import (its detection ops stay unusable, and nothing here calls them).
SGLang's own memory-cache code is untouched.
"""

from __future__ import annotations

_SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold, Tensor? polygons=None) -> Tensor",
}


def allow_cpu_torchvision() -> None:
    import importlib.util

    import torch

    if importlib.util.find_spec("torchvision") is None:
        return
    for name, schema in _SCHEMAS.items():
        namespace, op = name.split("::")
        if not hasattr(getattr(torch.ops, namespace), op):
            torch.library.define(name, schema)
