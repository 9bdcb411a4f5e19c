"""The integrations' own CURVE credentials: `lmcache_mp.curve_server_key` and
`lmcache_mp.curve_client_key` in vLLM's kv_connector_extra_config and in SGLang's storage extra
config reach every client the integration makes, so that engines of one machine connect as
different clients (tenants) without process-wide environment variables."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lmcache_mp import Client, Server, ServerConfig  # noqa: E402
from lmcache_mp.errors import ServerUnavailable  # noqa: E402
from lmcache_mp.integration.connector_core import ConnectorConfig, SchedulerCore, WorkerCore  # noqa: E402
from lmcache_mp.integration.sglang_settings import SGLangStorageSettings  # noqa: E402
from lmcache_mp.server.cli import main as server_cli  # noqa: E402

SGLANG_BASE = {"interface_v1": 1}


@pytest.fixture(autouse=True)
def no_curve_env(monkeypatch):
    """The credentials come from the configs under test, never from the environment."""
    monkeypatch.delenv("LMCACHE_MP_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("LMCACHE_MP_CURVE_CLIENT_KEY", raising=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("keys"))
    assert server_cli(["keygen", d]) == 0
    assert server_cli(["keygen", d, "--client", "b"]) == 0
    return d


@pytest.fixture(scope="module")
def server(keys):
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="16MiB", http_addr="off",
                              curve_secret_key=f"{keys}/server.key_secret", curve_clients=f"{keys}/clients")).start()
    yield srv
    srv.stop()


def creds(keys: str, client: str = "b") -> dict:
    return {"lmcache_mp.curve_server_key": f"{keys}/server.key",
            "lmcache_mp.curve_client_key": f"{keys}/client-secret/{client}.key_secret"}


def cpu_cache() -> list:
    """A small KV cache of vLLM's CPU layout (per layer: blocks, heads, block size, 2 x head size)."""
    return [torch.zeros(8, 2, 16, 32, dtype=torch.bfloat16) for _ in range(2)]


# ---- parsing ---------------------------------------------------------------------------------


def test_both_configs_take_the_key_files(keys):
    cfg = ConnectorConfig.from_extra_config(creds(keys), block_size=16)
    assert (cfg.curve_server_key, cfg.curve_client_key) == (f"{keys}/server.key", f"{keys}/client-secret/b.key_secret")
    s = SGLangStorageSettings.from_extra_config({**SGLANG_BASE, **creds(keys)})
    assert (s.curve_server_key, s.curve_client_key) == (f"{keys}/server.key", f"{keys}/client-secret/b.key_secret")
    # none given: empty, the client's environment variables (or no CURVE) as before
    assert ConnectorConfig.from_extra_config({}).curve_server_key == ""
    assert SGLangStorageSettings.from_extra_config(SGLANG_BASE).curve_client_key == ""


@pytest.mark.parametrize("setting", ["curve_server_key", "curve_client_key"])
@pytest.mark.parametrize("parse", [lambda e: ConnectorConfig.from_extra_config(e),
                                   lambda e: SGLangStorageSettings.from_extra_config({**SGLANG_BASE, **e})],
                         ids=["vllm", "sglang"])
def test_a_missing_key_file_is_one_clear_error_when_parsed(keys, tmp_path, setting, parse):
    missing = str(tmp_path / "nowhere" / "x.key")
    extra = {**creds(keys), f"lmcache_mp.{setting}": missing}
    with pytest.raises(ValueError) as e:
        parse(extra)
    assert f"lmcache_mp.{setting}" in str(e.value) and missing in str(e.value) and "does not exist" in str(e.value)


@pytest.mark.parametrize("parse", [lambda e: ConnectorConfig.from_extra_config(e),
                                   lambda e: SGLangStorageSettings.from_extra_config({**SGLANG_BASE, **e})],
                         ids=["vllm", "sglang"])
def test_wrong_key_files_are_refused_when_parsed(keys, tmp_path, parse):
    # the client's public key where its secret key belongs
    with pytest.raises(ValueError, match=r"lmcache_mp\.curve_client_key: .* holds no secret key"):
        parse({**creds(keys), "lmcache_mp.curve_client_key": f"{keys}/clients/b.key"})
    junk = tmp_path / "junk.key"
    junk.write_text("not a key\n")
    with pytest.raises(ValueError, match=r"lmcache_mp\.curve_server_key: .* is not a CURVE key file"):
        parse({**creds(keys), "lmcache_mp.curve_server_key": str(junk)})
    with pytest.raises(ValueError, match=r"lmcache_mp\.curve_client_key needs the server's public key"):
        parse({"lmcache_mp.curve_client_key": f"{keys}/client-secret/b.key_secret"})


# ---- the clients the integrations make --------------------------------------------------------


def test_without_keys_the_server_refuses(server):
    with pytest.raises(ServerUnavailable):
        Client(server.url, connect_timeout=0.5).close()


def test_vllm_scheduler_and_worker_connect_with_the_configured_key(server, keys, tmp_path):
    cfg = ConnectorConfig.from_extra_config({"lmcache_mp.url": server.url, "lmcache_mp.connect_timeout": 5,
                                             **creds(keys)}, model="tiny", block_size=16)
    sched = SchedulerCore(cfg)
    worker = WorkerCore(cfg, rank=0)
    try:
        sched.start()
        client = sched.link.get()
        assert client is not None and client.curve and client.ping(timeout=5) >= 0
        # the worker's link, as it connects once its KV cache is known (here: a small CPU cache)
        worker.register_kv_caches(cpu_cache())
        client = worker.link.get()
        assert client is not None and client.curve and client.ping(timeout=5) >= 0
    finally:
        worker.close()
        sched.close()

    # the same config without keys: the scheduler's link never connects (a miss, not an error)
    plain = ConnectorConfig.from_extra_config({"lmcache_mp.url": server.url, "lmcache_mp.connect_timeout": 0.5},
                                              block_size=16)
    sched = SchedulerCore(plain)
    try:
        sched.start()
        assert sched.link.get() is None
    finally:
        sched.close()
    with pytest.raises(ServerUnavailable):
        sched.link._make_client(server.url, 1.0, 0.5)


def test_sglang_link_connects_with_the_configured_key(server, keys):
    s = SGLangStorageSettings.from_extra_config({**SGLANG_BASE, "lmcache_mp.url": server.url, **creds(keys)})
    link = s.make_link("lmcache-mp sglang tp0")
    try:
        client = link.connect(wait=5)
        assert client is not None and client.curve and client.ping(timeout=5) >= 0
    finally:
        link.close()
    plain = SGLangStorageSettings.from_extra_config({**SGLANG_BASE, "lmcache_mp.url": server.url,
                                                    "lmcache_mp.connect_timeout": 0.5})
    link = plain.make_link("lmcache-mp sglang tp0")
    try:
        assert link.connect(wait=3) is None
        with pytest.raises(ServerUnavailable):
            link._make_client(server.url, 1.0, 0.5)
    finally:
        link.close()


def test_the_client_key_decides_the_tenant(keys, tmp_path):
    """One process, a vLLM engine and an SGLang instance configured with different client keys:
    on a server with tenants each connection is its key's tenant (the point of taking the keys
    from the integrations' configs, not the process's environment)."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\n'
                       f'[tenants.bob]\ncurve_keys = ["{keys}/clients/b.key"]\n')
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="16MiB", http_addr="off",
                              curve_secret_key=f"{keys}/server.key_secret", tenants=str(tenants))).start()
    sched = worker = link = None
    try:
        cfg = ConnectorConfig.from_extra_config({"lmcache_mp.url": srv.url, **creds(keys, "client")}, model="tiny",
                                                block_size=16)
        sched = SchedulerCore(cfg)
        sched.start()
        worker = WorkerCore(cfg, rank=0)
        worker.register_kv_caches(cpu_cache())
        assert worker.link.get() is not None  # registered (server-side copies), as alice
        s = SGLangStorageSettings.from_extra_config({**SGLANG_BASE, "lmcache_mp.url": srv.url, **creds(keys, "b")})
        link = s.make_link("lmcache-mp sglang tp0")
        vllm_client, sglang_client = sched.link.get(), link.connect(wait=5)
        assert vllm_client is not None and sglang_client is not None
        assert vllm_client.status(timeout=5)["tenant"] == "alice"
        assert sglang_client.status(timeout=5)["tenant"] == "bob"
    finally:
        if link is not None:
            link.close()
        if worker is not None:
            worker.close()
        if sched is not None:
            sched.close()
        srv.stop()
