"""What of vLLM's source the connector relies on, as data: classes, method signatures, fields, names.

    python connector_interface.py SOURCE > vllm-X.Y.Z-connector-interface.json

SOURCE is a vLLM wheel or a directory holding the `vllm` package (site-packages). The source is
parsed, never imported, so any vLLM release can be described on any machine (0.33's wheel is
built for CUDA). test_vllm_interface.py checks the connector against these descriptions.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import zipfile

# module -> classes described in full (others: only the module's top-level names)
MODULES = {
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": [
        "KVConnectorBase_V1", "SupportsHMA", "KVConnectorMetadata", "KVConnectorWorkerMetadata"],
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py": ["KVConnectorStats", "KVConnectorPromMetrics"],
    "vllm/distributed/kv_events.py": ["BlockStored", "BlockRemoved", "KVEventBatch"],
    "vllm/v1/core/kv_cache_utils.py": [],
    "vllm/v1/kv_cache_interface.py": ["KVCacheConfig", "KVCacheGroupSpec"],
    "vllm/v1/metrics/cache_hit_source.py": [],
    "vllm/distributed/parallel_state.py": [],
    "vllm/v1/core/block_pool.py": ["BlockPool"],
    "vllm/v1/kv_cache_layout.py": ["KVCacheLayout"],
    "vllm/distributed/kv_transfer/kv_connector/utils.py": [],
    "vllm/v1/attention/backends/utils.py": [],
}


def _decorators(node) -> set[str]:
    out = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.add(d.id if isinstance(d, ast.Name) else getattr(d, "attr", ""))
    return out


def _raises_not_implemented(node) -> bool:
    for stmt in node.body:
        if isinstance(stmt, ast.Raise) and stmt.exc is not None:
            exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
            if getattr(exc, "id", None) == "NotImplementedError":
                return True
    return False


def describe_function(node) -> dict:
    decos = _decorators(node)
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    if "staticmethod" not in decos:
        positional = positional[1:]  # self / cls
    kind = "classmethod" if "classmethod" in decos else "property" if "property" in decos else \
        "staticmethod" if "staticmethod" in decos else "method"
    return {"kind": kind, "params": positional, "defaults": len(args.defaults),
            "kwonly": [a.arg for a in args.kwonlyargs], "varargs": args.vararg is not None,
            "varkw": args.kwarg is not None,
            "abstract": "abstractmethod" in decos or _raises_not_implemented(node)}


def describe_class(node) -> dict:
    methods, fields = {}, {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods[item.name] = describe_function(item)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            fields[item.target.id] = {"default": item.value is not None}
    bases = [ast.unparse(b) for b in node.bases if not isinstance(b, ast.keyword)]
    return {"bases": bases, "methods": methods, "fields": fields}


def describe_module(source: str, classes: list[str]) -> dict:
    tree = ast.parse(source)
    names, described = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef) and node.name in classes:
                described[node.name] = describe_class(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If):  # names defined under TYPE_CHECKING or version checks
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
    return {"names": sorted(names), "classes": described}


def read_sources(source: str) -> tuple[str, dict[str, str]]:
    """(vLLM version, module path -> text)."""
    if os.path.isdir(source):
        def read(path):
            with open(os.path.join(source, path), encoding="utf-8") as f:
                return f.read()
    else:
        archive = zipfile.ZipFile(source)

        def read(path):
            return archive.read(path).decode("utf-8")
    texts = {path: read(path) for path in MODULES}
    version = "unknown"
    try:
        for line in read("vllm/_version.py").splitlines():
            if line.startswith("__version__ =") or line.startswith("version ="):
                version = line.split("=")[-1].strip().strip("'\"")
                break
    except (KeyError, FileNotFoundError):
        pass
    return version, texts


def describe(source: str) -> dict:
    version, texts = read_sources(source)
    return {"vllm": version,
            "modules": {path: describe_module(text, MODULES[path]) for path, text in texts.items()}}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    json.dump(describe(args[0]), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
