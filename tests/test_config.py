"""ServerConfig: sizes with units, validation messages, and the precedence of the sources
(CLI > LMCACHE_MP_* environment > TOML file > defaults)."""

import pytest

from lmcache_mp.config import ServerConfig, format_size, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize("text, n", [
    ("64GiB", 64 * GiB),
    ("64 GiB", 64 * GiB),
    (" 512MiB ", 512 * MiB),
    ("512mib", 512 * MiB),
    ("1.5G", int(1.5 * GiB)),
    ("2T", 2 * TiB),
    ("1TiB", TiB),
    ("4k", 4 * KiB),
    ("4KiB", 4 * KiB),
    ("1GB", GiB),  # every spelling is binary: 4GB, 4g and 4GiB are the same
    ("3MB", 3 * MiB),
    ("2kb", 2 * KiB),
    ("4g", 4 * GiB),
    ("4096", 4096),
    ("4096B", 4096),
    (".5M", MiB // 2),
    (0, 0),
    (12345, 12345),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "GiB", "12 XB", "-1GiB", "1e3", "1.2.3G", "64 Gi B", "lots", True, -1])
def test_parse_size_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1000, "1000 B"), (1536, "1.5 KiB"), (64 * GiB, "64.0 GiB"),
                                     (3 * TiB, "3.0 TiB"), (5 * MiB, "5.0 MiB")])
def test_format_size(n, text):
    assert format_size(n) == text


def test_defaults():
    c = ServerConfig()
    assert c.l1_size == 4 * GiB and c.chunk_size == 256 and c.device == "auto"
    assert c.slab_size == 256 * MiB and c.lease_ttl == 30.0 and c.log_level == "INFO"


def test_sizes_in_the_dataclass_are_parsed():
    c = ServerConfig(l1_size="64GiB", staging_size="32 MiB", slab_size="128MiB")
    assert (c.l1_size, c.staging_size, c.slab_size) == (64 * GiB, 32 * MiB, 128 * MiB)


def test_a_small_l1_gets_small_slabs():
    c = ServerConfig(l1_size="1GiB")
    assert c.slab_size == 64 * MiB and c.l1_size // c.slab_size == 16
    assert ServerConfig(l1_size="64GiB").slab_size == 256 * MiB


@pytest.mark.parametrize("kwargs, match", [
    (dict(url="http://localhost:1"), "url must start with"),
    (dict(chunk_size=0), "chunk_size must be positive"),
    (dict(device="tpu"), "device must be one of"),
    (dict(transfer_mode="fast"), "transfer_mode must be one of"),
    (dict(slab_size="5000"), "multiple of 4 KiB"),
    (dict(l1_size="1KiB"), "must hold at least one slab"),
    (dict(lease_ttl=0), "lease_ttl and heartbeat_timeout must be positive"),
    (dict(heartbeat_timeout=-1.0), "lease_ttl and heartbeat_timeout must be positive"),
    (dict(direct_ctas=0), "direct_ctas must be positive"),
    (dict(l1_size="many"), "not a size"),
    (dict(log_level="verbose"), "log_level"),
    (dict(chunk_size=1.5), "chunk_size must be an integer"),
    (dict(chunk_size=True), "chunk_size must be an integer"),
    (dict(lease_ttl="soon"), "lease_ttl must be a number"),
    (dict(l2_disk_write="sometimes"), "l2_disk_write must be one of"),
])
def test_bad_values_give_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)


def test_each_l2_tier_has_its_own_write_policy_and_l2_write_sets_the_rest():
    c = ServerConfig()
    assert (c.l2_write_of("disk", "evicted"), c.l2_write_of("redis", "all")) == ("evicted", "all")
    c = ServerConfig.from_sources(cli={"l2_write": "none", "l2_redis_write": "all"})
    assert [c.l2_write_of(t, "evicted") for t in ("disk", "redis", "mooncake")] == ["none", "all", "none"]
    assert ServerConfig().l2_queue_size == 0  # a quarter of L1 (docs/L2.md; the status shows the bytes)


def test_log_level_is_case_insensitive():
    assert ServerConfig(log_level="debug").log_level == "debug"
    assert ServerConfig(log_level="WARNING").log_level == "WARNING"


def _write(tmp_path, text):
    path = tmp_path / "server.toml"
    path.write_text(text)
    return str(path)


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path):
    conf = _write(tmp_path, 'l1_size = "1GiB"\nchunk_size = 64\nlease_ttl = 5\ndevice = "cpu"\n')
    env = {"LMCACHE_MP_CHUNK_SIZE": "128", "LMCACHE_MP_LEASE_TTL": "7.5", "LMCACHE_MP_LOG_LEVEL": "DEBUG"}
    cli = {"lease_ttl": 9.0, "chunk_size": None, "url": None}  # None: not given on the command line
    c = ServerConfig.from_sources(cli=cli, env=env, config_file=conf)
    assert c.l1_size == GiB  # file only
    assert c.device == "cpu"  # file only
    assert c.chunk_size == 128  # env over file
    assert c.log_level == "DEBUG"  # env only
    assert c.lease_ttl == 9.0  # cli over env over file
    assert c.url == ServerConfig().url  # nobody set it: default
    assert c.heartbeat_timeout == 10.0


def test_each_source_alone(tmp_path):
    assert ServerConfig.from_sources(env={}).chunk_size == 256
    assert ServerConfig.from_sources(env={"LMCACHE_MP_L1_SIZE": "64GiB"}).l1_size == 64 * GiB
    assert ServerConfig.from_sources(env={}, config_file=_write(tmp_path, "l1_size = 2147483648")).l1_size == 2 * GiB
    assert ServerConfig.from_sources(cli={"l1_size": "3GiB"}, env={}).l1_size == 3 * GiB


def test_env_defaults_to_the_process_environment(monkeypatch):
    monkeypatch.setenv("LMCACHE_MP_CHUNK_SIZE", "32")
    monkeypatch.setenv("LMCACHE_MP_HEARTBEAT_TIMEOUT", "2.5")
    monkeypatch.setenv("LMCACHE_MP_CUDA", "OFF")  # the build's, not a server setting: fine
    c = ServerConfig.from_sources()
    assert c.chunk_size == 32 and c.heartbeat_timeout == 2.5
    assert c.given == {"chunk_size", "heartbeat_timeout"}


def test_an_environment_variable_that_is_no_setting_is_refused_as_a_config_key_is(monkeypatch):
    """A typo would otherwise leave the default in force without a word."""
    monkeypatch.setenv("LMCACHE_MP_L1_SIZ", "1GiB")
    with pytest.raises(ValueError, match=r"environment variable LMCACHE_MP_L1_SIZ: no such setting \(did you mean "
                                         r"LMCACHE_MP_L1_SIZE\?\)"):
        ServerConfig.from_sources()


def test_file_may_use_a_server_table(tmp_path):
    conf = _write(tmp_path, '[server]\nl1_size = "8GiB"\nurl = "ipc:///tmp/x.sock"\n')
    c = ServerConfig.from_sources(env={}, config_file=conf)
    assert c.l1_size == 8 * GiB and c.url == "ipc:///tmp/x.sock"


def test_file_with_unknown_settings_is_rejected(tmp_path):
    conf = _write(tmp_path, 'l1_size = "1GiB"\nl1_sise = "2GiB"\n')
    with pytest.raises(ValueError, match=r"unknown settings .*l1_sise"):
        ServerConfig.from_sources(env={}, config_file=conf)


def test_missing_or_broken_files_are_named(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match=f"config file {missing}: no such file"):
        ServerConfig.from_sources(env={}, config_file=missing)
    broken = _write(tmp_path, "l1_size = = 3")
    with pytest.raises(ValueError, match=f"config file {broken}: not valid TOML: .*line 1"):
        ServerConfig.from_sources(env={}, config_file=broken)


@pytest.mark.parametrize("env, match", [
    ({"LMCACHE_MP_CHUNK_SIZE": "abc"}, r"LMCACHE_MP_CHUNK_SIZE.*chunk_size must be an integer.*'abc'"),
    ({"LMCACHE_MP_LEASE_TTL": "forever"}, r"LMCACHE_MP_LEASE_TTL.*lease_ttl must be a number"),
    ({"LMCACHE_MP_L1_SIZE": "huge"}, r"LMCACHE_MP_L1_SIZE: l1_size: not a size: 'huge'"),
    ({"LMCACHE_MP_DEVICE": "gpu"}, r"device must be one of .* \(device from LMCACHE_MP_DEVICE\)"),
    ({"LMCACHE_MP_L1_SIZE": "1KiB"}, r"at least one slab \(l1_size from LMCACHE_MP_L1_SIZE\)"),
    ({"LMCACHE_MP_LOCAL_LANE": "maybe"}, r"LMCACHE_MP_LOCAL_LANE: local_lane must be on or off .*'maybe'"),
])
def test_bad_env_values_name_the_setting(env, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig.from_sources(env=env)


@pytest.mark.parametrize("text, match", [
    ("chunk_size = 1.5", "chunk_size must be an integer"),
    ('chunk_size = "many"', "chunk_size must be an integer"),
    ("lease_ttl = true", "lease_ttl must be a number"),
    ('log_level = "chatty"', "log_level"),
    ("url = 5", "url must be a string"),
])
def test_bad_file_values_name_the_setting(tmp_path, text, match):
    conf = _write(tmp_path, text + "\n")
    with pytest.raises(ValueError, match=match) as info:
        ServerConfig.from_sources(env={}, config_file=conf)
    if "log_level" not in text:  # type errors name the file; range checks come later
        assert "server.toml" in str(info.value)


@pytest.mark.parametrize("text, on", [("1", True), ("true", True), ("Yes", True), ("ON", True), (" on ", True),
                                      ("0", False), ("false", False), ("no", False), ("Off", False)])
def test_on_off_settings_from_the_environment(text, on):
    assert ServerConfig.from_sources(env={"LMCACHE_MP_LOCAL_LANE": text}).local_lane is on
    assert ServerConfig.from_sources(env={"LMCACHE_MP_L2_REDIS_CLUSTER": text}).l2_redis_cluster is on


@pytest.mark.parametrize("text, match", [
    ("local_lane = false", None),
    ('local_lane = "off"', None),
    ('local_lane = "maybe"', "local_lane must be on or off"),
    ("local_lane = 2", "local_lane must be on or off"),
])
def test_on_off_settings_from_a_file(tmp_path, text, match):
    conf = _write(tmp_path, text + "\n")
    if match is None:
        assert ServerConfig.from_sources(env={}, config_file=conf).local_lane is False
        return
    with pytest.raises(ValueError, match=f"config file {conf}: {match}"):
        ServerConfig.from_sources(env={}, config_file=conf)


def test_a_check_across_settings_names_where_each_came_from(tmp_path):
    conf = _write(tmp_path, 'curve_clients = "/etc/keys/clients"\n')
    where = f"curve_clients needs curve_secret_key \\(curve_clients from config file {conf}\\)"
    with pytest.raises(ValueError, match=where):
        ServerConfig.from_sources(env={}, config_file=conf)
    with pytest.raises(ValueError, match=r"lease_ttl from --lease-ttl; heartbeat_timeout from LMCACHE_MP_HEARTBEAT"):
        ServerConfig.from_sources(cli={"lease_ttl": 0.0}, env={"LMCACHE_MP_HEARTBEAT_TIMEOUT": "1"})
