"""The config contract: shipped files validate, every problem is reported with its key path, env wins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from routerd import config

ROOT = Path(__file__).resolve().parent.parent


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "routerd", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("name", ["routerd.toml", "production.example.toml"])
def test_shipped_configs_are_valid(name: str) -> None:
    result = _check(ROOT / "config" / name)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_local_default_has_two_sim_fleets_one_tp2() -> None:
    cfg = config.load(ROOT / "config" / "routerd.toml", environ={})
    assert [f.engine for f in cfg.fleets] == ["sim", "sim"]
    assert sorted(f.tensor_parallel_size for f in cfg.fleets) == [1, 2]
    assert cfg.redis.url == "embedded"
    assert cfg.ray.address == ""


def test_check_config_lists_every_problem_with_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        """
[http]
port = "eighty"
colour = "blue"

[routing]
max_attempts = 0

[[fleets]]
name = "a"
model = "m"

[[fleets]]
name = "b"
model = "m2"
replicas = -1

[[fleets]]
name = "c"
model = "m3"
engine = "static"
"""
    )
    result = _check(bad)
    assert result.returncode == 78
    lines = result.stderr.splitlines()
    assert any(line.startswith("$.http.port:") and "int" in line for line in lines)
    assert any(line.startswith("$.http.colour: unknown key") for line in lines)
    assert any(line.startswith("$.routing.max_attempts:") and ">= 1" in line for line in lines)
    assert any(line.startswith("$.fleets[1].replicas:") and ">= 0" in line for line in lines)
    assert any(line.startswith("$.fleets[2].urls:") for line in lines)


UNKNOWN_PLUGINS = """
[routing]
policy = "fastest"

[[fleets]]
name = "a"
model = "m"
engine = "sim"

[[fleets]]
name = "b"
model = "m2"
engine = "foo"

[[fleets]]
name = "c"
model = "m3"
engine = "static"
urls = ["http://127.0.0.1:9"]
"""
UNKNOWN_PLUGIN_LINES = [
    "$.routing.policy: unknown policy 'fastest' "
    "(installed: cache_aware, least_load, power_of_two, round_robin)",
    "$.fleets[1].engine: unknown launcher 'foo' (installed: sim, vllm)",
]


def test_check_config_names_an_unknown_policy_and_launcher(tmp_path: Path) -> None:
    """Both plugin names are checked against the installed entry points before anything starts (an
    unknown engine used to pass check-config and fail later inside its Ray actor); static needs none."""
    path = tmp_path / "plugins.toml"
    path.write_text(UNKNOWN_PLUGINS)
    result = _check(path)
    assert result.returncode == 78
    assert [line for line in result.stderr.splitlines() if line.startswith("$.")] == UNKNOWN_PLUGIN_LINES


def test_run_refuses_an_unknown_policy_and_launcher_with_78(tmp_path: Path) -> None:
    path = tmp_path / "plugins.toml"
    path.write_text(UNKNOWN_PLUGINS)
    result = subprocess.run([sys.executable, "-m", "routerd", "run", "--config", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 78
    assert result.stdout.splitlines() == UNKNOWN_PLUGIN_LINES


def test_not_toml_and_missing_file_exit_78(tmp_path: Path) -> None:
    bad = tmp_path / "x.toml"
    bad.write_text("[http\nport=1")
    assert _check(bad).returncode == 78
    assert _check(tmp_path / "missing.toml").returncode == 78
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[daemon]\nstate_dir = "caf\xe9"\n')
    with pytest.raises(config.ConfigError) as info:  # not a UnicodeDecodeError: SIGHUP must survive it
        config.load(latin1)
    assert info.value.problems[0].startswith("$: ")
    assert "UTF-8" in info.value.problems[0]
    assert _check(latin1).returncode == 78


def test_unknown_section_and_semantic_errors() -> None:
    with pytest.raises(config.ConfigError) as info:
        config.parse({"nope": {}, "fleets": [
            {"name": "a", "model": "m", "engine_args": {"disable-log-stats": True}},
            {"name": "a", "model": "m"},
        ]}, environ={})
    problems = info.value.problems
    assert any(p.startswith("$.nope: unknown section") for p in problems)
    # the first structural pass succeeds for fleets, so only the unknown section is reported first
    with pytest.raises(config.ConfigError) as info:
        config.parse({"fleets": [
            {"name": "a", "model": "m", "engine_args": {"disable-log-stats": True}},
            {"name": "a", "model": "m"},
        ]}, environ={})
    problems = info.value.problems
    assert any("$.fleets[1].name: duplicate" in p for p in problems)
    assert any("$.fleets[1].model:" in p for p in problems)
    assert any("disable-log-stats" in p for p in problems)


def test_env_overrides_win_and_are_typed() -> None:
    cfg = config.parse({"http": {"port": 1234}}, environ={
        "ROUTERD_HTTP_PORT": "9999",
        "ROUTERD_HTTP_API_KEYS": "k1, k2",
        "ROUTERD_REDIS_PASSWORD": "s3cret",
        "ROUTERD_DAEMON_STOP_ENGINES_ON_EXIT": "true",
        "ROUTERD_ROUTING_SCRAPE_INTERVAL_S": "0.05",
        "UNRELATED": "x",
    })
    assert cfg.http.port == 9999
    assert cfg.http.api_keys == ["k1", "k2"]
    assert cfg.redis.password == "s3cret"
    assert cfg.daemon.stop_engines_on_exit is True
    assert cfg.routing.scrape_interval_s == 0.05


def test_env_override_errors_name_the_variable() -> None:
    with pytest.raises(config.ConfigError) as info:
        config.parse({}, environ={"ROUTERD_HTTP_PROT": "1", "ROUTERD_HTTP_PORT": "x"})
    problems = info.value.problems
    assert any("$ROUTERD_HTTP_PROT" in p for p in problems)
    assert any(p.startswith("$.http.port:") for p in problems)


def test_config_is_frozen() -> None:
    cfg = config.parse({}, environ={})
    with pytest.raises(AttributeError):
        cfg.http.port = 1  # type: ignore[misc]


@pytest.mark.parametrize("address", ["10.0.0.5", "ray://10.0.0.5:10001", "auto", "head:port"])
def test_ray_address_must_be_host_port(address: str) -> None:
    # Without this check "10.0.0.5" passed validation and routerd died at start-up with a ValueError.
    with pytest.raises(config.ConfigError) as info:
        config.parse({"ray": {"address": address}}, environ={})
    assert info.value.problems[0].startswith("$.ray.address: expected host:port")


@pytest.mark.parametrize("address", ["", "127.0.0.1:6379", "ray-head.internal:6379", "[::1]:6379"])
def test_ray_addresses_that_are_accepted(address: str) -> None:
    assert config.parse({"ray": {"address": address}}, environ={}).ray.address == address


def test_a_number_out_of_range_is_refused_with_its_key_path(tmp_path: Path) -> None:
    """A limit past 2**64 passed check-config and SIGHUP, then ended the daemon at the tenant's first
    request (issue 18): every number is refused at load, exit 78, with where it is."""
    bad = tmp_path / "bad.toml"
    bad.write_text(
        """
[daemon]
drain_timeout_s = inf

[admission]
aging_s = nan

[redis]
result_ttl_s = 99999999999999999999

[[fleets]]
name = "a"
model = "m"
engine_args = { max-num-seqs = 0 }

[[tenants]]
name = "t"
requests_per_minute = 99999999999999999999
tokens_per_minute = 99999999999999999999
"""
    )
    result = _check(bad)
    assert result.returncode == 78
    lines = result.stderr.splitlines()
    for path, bound in [("$.tenants[0].requests_per_minute", "<= 1000000000"),
                        ("$.tenants[0].tokens_per_minute", "<= 1000000000000"),
                        ("$.redis.result_ttl_s", "<= 31622400"), ("$.daemon.drain_timeout_s", "<= 86400"),
                        ("$.admission.aging_s", ">= 0.001"),
                        ("$.fleets[0].engine_args.max-num-seqs", "1 to")]:
        assert any(line.startswith(path + ":") and bound in line for line in lines), (path, lines)


def _numbers(typ: msgspec.inspect.Type, path: str) -> list[tuple[str, msgspec.inspect.Type]]:
    """Every int and float in a config type, with its key path."""
    if isinstance(typ, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        return [(path, typ)]
    if isinstance(typ, msgspec.inspect.StructType):
        return [n for f in typ.fields for n in _numbers(f.type, f"{path}.{f.name}")]
    if isinstance(typ, msgspec.inspect.UnionType):
        return [n for t in typ.types for n in _numbers(t, path)]
    if isinstance(typ, msgspec.inspect.ListType):
        return _numbers(typ.item_type, path + "[]")
    if isinstance(typ, msgspec.inspect.DictType):
        return _numbers(typ.value_type, path + "{}")
    return []


def test_every_number_in_the_config_has_both_bounds() -> None:
    numbers = _numbers(msgspec.inspect.type_info(config.Config), "$")
    assert len(numbers) > 60  # the walk found the tree
    unbounded = [path for path, t in numbers
                 if (t.ge is None and t.gt is None) or (t.le is None and t.lt is None)]
    assert unbounded == []


def test_redis_tls_and_cluster_settings_that_contradict_or_cannot_be_read(tmp_path: Path) -> None:
    cert = tmp_path / "client.crt"
    cert.write_text("PEM")
    cases = [
        ({"url": "redis://h:6379/0", "ssl_ca_certs": str(cert)},
         "$.redis.ssl_ca_certs: TLS settings need a rediss://"),
        ({"url": "rediss://h:6379/0", "ssl_keyfile": str(cert)},
         "$.redis.ssl_keyfile: a client key needs its certificate"),
        ({"url": "rediss://h:6379/0", "ssl_certfile": str(tmp_path / "gone.crt")},
         "$.redis.ssl_certfile: cannot read"),
        ({"url": "embedded", "cluster": True}, "$.redis.cluster: the embedded redis-server is not a cluster"),
        ({"url": "redis://h:6379/2", "cluster": True},
         "$.redis.cluster: a Redis Cluster has database 0 only"),
    ]
    for redis, problem in cases:
        with pytest.raises(config.ConfigError) as e:
            config.parse({"redis": redis}, environ={})
        assert any(p.startswith(problem) for p in e.value.problems), (redis, e.value.problems)
    ok = config.parse({"redis": {"url": "rediss://h:6379/0", "ssl_ca_certs": str(cert),
                                 "ssl_certfile": str(cert), "cluster": True}}, environ={})
    assert ok.redis.stream == "{routerd}:requests"
def test_sentinel_settings_that_contradict_each_other_are_named(tmp_path: Path) -> None:
    """``[redis] sentinels``: the master's address comes from them, so a URL naming a host, an embedded
    server, a missing ``service_name`` or a malformed address is a ``check-config`` error (exit 78);
    a service name or sentinel password without sentinels too."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[redis]\nurl = "redis://10.0.0.5:6379/0"\nsentinels = ["127.0.0.1:26379", "s2"]\n')
    result = _check(bad)
    assert result.returncode == 78
    assert "$.redis.url: with [redis] sentinels the master's address comes from them" in result.stderr
    assert "$.redis.sentinels[1]: expected \"host:port\"" in result.stderr
    assert "$.redis.service_name:" in result.stderr
    with pytest.raises(config.ConfigError, match=r"\$\.redis\.url: \"embedded\""):
        config.parse({"redis": {"url": "embedded", "sentinels": ["h:1"], "service_name": "m"}}, environ={})
    with pytest.raises(config.ConfigError, match=r"\$\.redis\.sentinel_password: set without"):
        config.parse({"redis": {"sentinel_password": "x"}}, environ={})
    ok = config.parse({"redis": {"url": "rediss:///2", "service_name": "m"}},
                      environ={"ROUTERD_REDIS_SENTINELS": "s1:26379, [::1]:26379"})
    assert ok.redis.sentinels == ["s1:26379", "[::1]:26379"]
    assert config.parse({"redis": {"sentinels": ["s1:26379"], "service_name": "m"}}, environ={})
