"""The connector against vLLM's connector interface of every release it claims to support.

vllm-X.Y.Z-connector-interface.json describes, from vLLM's source, what the connector relies on
(connector_interface.py makes them: 0.32.0 from the CPU build the end-to-end tests run, 0.33.0
from its CUDA wheel, which does not run here). The connector's own source is parsed too, so
this needs no vLLM: every abstract method is implemented, every hook we override has vLLM's
signature, every name we import from vLLM exists, every event field we fill is one of vLLM's.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OURS = HERE.parents[1] / "python" / "lmcache_mp" / "integration"
SUPPORTED = ["0.32.0", "0.33.0"]

import sys  # noqa: E402

sys.path.insert(0, str(HERE))
from connector_interface import MODULES, describe, describe_class  # noqa: E402


def manifest(version: str) -> dict:
    return json.loads((HERE / f"vllm-{version}-connector-interface.json").read_text())


def our_tree(name: str) -> ast.Module:
    return ast.parse((OURS / name).read_text())


def our_classes() -> dict[str, dict]:
    out = {}
    for name in ("vllm.py", "vllm_stats.py"):
        for node in our_tree(name).body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = describe_class(node)
    return out


def vllm_imports() -> list[tuple[str, str, str]]:
    """(our file, vLLM module file, name) of every `from vllm... import name` that runs (those
    under `if TYPE_CHECKING:` never do)."""
    out = []
    for path in sorted(OURS.glob("*.py")):
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm")
                    and id(node) not in typing_only):
                module = node.module.replace(".", "/") + ".py"
                out += [(path.name, module, a.name) for a in node.names]
    return out


@pytest.fixture(params=SUPPORTED)
def vllm(request) -> dict:
    return manifest(request.param)


def test_every_name_we_import_from_vllm_exists(vllm):
    imports = vllm_imports()
    assert imports
    for ours, module, name in imports:
        if module[: -len(".py")] + f"/{name}.py" in vllm["modules"]:  # a module: `from vllm.v1 import x as y`
            continue
        assert module in vllm["modules"], f"{ours} imports from {module}: add it to connector_interface.MODULES"
        assert name in vllm["modules"][module]["names"], f"vLLM {vllm['vllm']} has no {module}:{name} ({ours})"


def test_connector_implements_the_abstract_hooks_with_vllms_signatures(vllm):
    base = vllm["modules"]["vllm/distributed/kv_transfer/kv_connector/v1/base.py"]["classes"]
    ours = our_classes()["LMCacheMPConnector"]["methods"]
    for cls in ("KVConnectorBase_V1", "SupportsHMA"):
        for name, spec in base[cls]["methods"].items():
            if spec["abstract"]:
                assert name in ours, f"{cls}.{name} (abstract in vLLM {vllm['vllm']}) is not implemented"
            if name in ours and name != "__init__":
                mine = ours[name]
                assert (mine["kind"], mine["params"]) == (spec["kind"], spec["params"]), \
                    f"{name}: ours {mine['kind']}{mine['params']}, vLLM {vllm['vllm']} {spec['kind']}{spec['params']}"
    assert ours["__init__"]["params"] == base["KVConnectorBase_V1"]["methods"]["__init__"]["params"]


@pytest.mark.parametrize("ours, theirs, module", [
    ("LMCacheMPStats", "KVConnectorStats", "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"),
    ("LMCacheMPPromMetrics", "KVConnectorPromMetrics", "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"),
    ("LMCacheMPWorkerMetadata", "KVConnectorWorkerMetadata", "vllm/distributed/kv_transfer/kv_connector/v1/base.py"),
])
def test_stats_and_worker_metadata_implement_vllms_base_classes(vllm, ours, theirs, module):
    base = vllm["modules"][module]["classes"][theirs]["methods"]
    mine = our_classes()[ours]["methods"]
    for name, spec in base.items():
        if spec["abstract"] or name in mine:
            assert name in mine, f"{ours} lacks {theirs}.{name} (vLLM {vllm['vllm']})"
            assert mine[name]["params"] == spec["params"], f"{ours}.{name}: {mine[name]['params']} vs {spec['params']}"


def test_events_fill_only_vllms_fields_and_every_required_one(vllm):
    events = vllm["modules"]["vllm/distributed/kv_events.py"]["classes"]
    calls = [n for n in ast.walk(our_tree("vllm_events.py")) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) in ("BlockStored", "BlockRemoved")]
    assert {c.func.id for c in calls} == {"BlockStored", "BlockRemoved"}
    for call in calls:
        fields = events[call.func.id]["fields"]
        given = {k.arg for k in call.keywords}
        assert given <= set(fields), f"{call.func.id}: {given - set(fields)} unknown to vLLM {vllm['vllm']}"
        required = {f for f, spec in fields.items() if not spec["default"]}
        assert required <= given, f"{call.func.id}: {required - given} required by vLLM {vllm['vllm']}"


def test_kv_cache_specs_and_block_pool_we_use_exist(vllm):
    interface = vllm["modules"]["vllm/v1/kv_cache_interface.py"]
    used = {n.attr for n in ast.walk(our_tree("vllm_specs.py"))
            if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "kv"}
    assert used and used <= set(interface["names"]), used - set(interface["names"])
    group_fields = set(interface["classes"]["KVCacheGroupSpec"]["fields"])
    assert {"layer_names", "kv_cache_spec", "enable_kv_transfer"} <= group_fields
    assert {"kv_cache_groups", "hash_block_size"} <= set(interface["classes"]["KVCacheConfig"]["fields"])
    pool = vllm["modules"]["vllm/v1/core/block_pool.py"]["classes"]["BlockPool"]["methods"]
    assert pool["touch"]["params"] == ["blocks"] and pool["free_blocks"]["params"] == ["ordered_blocks"]


def test_what_changed_from_032_to_033_is_handled():
    """0.33 added sleep-mode hooks (the connector declines sleep mode: the server maps the KV
    cache, which sleep mode unmaps) and lookahead token ids on BlockStored (optional)."""
    old, new = (manifest(v)["modules"]["vllm/distributed/kv_transfer/kv_connector/v1/base.py"]["classes"]
                ["KVConnectorBase_V1"]["methods"] for v in SUPPORTED)
    assert set(new) - set(old) == {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}
    assert set(old) - set(new) == set()
    assert "supports_sleep_mode" in our_classes()["LMCacheMPConnector"]["methods"]
    stored = [manifest(v)["modules"]["vllm/distributed/kv_events.py"]["classes"]["BlockStored"]["fields"]
              for v in SUPPORTED]
    assert set(stored[1]) - set(stored[0]) == {"lookahead_token_ids"} and stored[1]["lookahead_token_ids"]["default"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_installed_vllm_is_the_one_described():
    import vllm

    site = Path(vllm.__file__).resolve().parents[1]
    current = describe(str(site))
    assert current["vllm"] in SUPPORTED
    assert current == manifest(current["vllm"]), "regenerate with connector_interface.py"
    assert set(MODULES) == set(current["modules"])
