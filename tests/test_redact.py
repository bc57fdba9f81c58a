"""Redaction: URLs shown without their passwords, every secret the config holds found, field names."""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import strategies as st

from routerd import config, redact
from routerd.config import parse


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret-pw@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
    ("redis://default:s3cret-pw@10.0.0.5:6379/0", "redis://default:***@10.0.0.5:6379/0"),
    ("rediss://app:p@ss:w0rd@redis.example:6380/1", "rediss://app:***@redis.example:6380/1"),
    ("http://user:engine-pw@127.0.0.1:8001", "http://user:***@127.0.0.1:8001"),
    ("redis://10.0.0.5:6379/0?password=s3cret-pw&db=1", "redis://10.0.0.5:6379/0?password=***&db=1"),
    ("http://token-only@127.0.0.1:8001", "http://token-only@127.0.0.1:8001"),  # no password part
    ("http://127.0.0.1:8001", "http://127.0.0.1:8001"),
    ("http://[::1]:8001/v1", "http://[::1]:8001/v1"),
    ("embedded", "embedded"),
])
def test_url_keeps_the_user_and_masks_the_password(url: str, shown: str) -> None:
    assert redact.url(url) == shown


def test_urls_inside_text_are_redacted() -> None:
    line = ("Error connecting to redis://:s3cret@127.0.0.1:6379/0; engine http://u:engine-pw@h:1/v1 "
            "and 'http://a:b@c' done")
    assert redact.text(line) == ("Error connecting to redis://:***@127.0.0.1:6379/0; engine "
                                 "http://u:***@h:1/v1 and 'http://a:***@c' done")


def test_authorization_values_inside_text_are_redacted() -> None:
    line = "Bad header b'Authorization: Bearer some-client-key.1', {'authorization': 'Basic dXNlcjpw'}"
    assert redact.text(line) == "Bad header b'Authorization: Bearer ***', {'authorization': 'Basic ***'}"
    assert redact.text("Basic auth is used") == "Basic auth is used"


@pytest.mark.parametrize(("name", "secret"), [
    ("api_keys", True), ("admin_api_key", True), ("password", True), ("HF_TOKEN", True),
    ("OPENAI_API_KEY", True), ("authorization", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("max_tokens", False), ("generation_tokens", False), ("key", False), ("redis_key", False),
    ("url", False), ("passes", False),
])
def test_secret_field_names_are_whole_words(name: str, secret: bool) -> None:
    assert redact.secret_name(name) is secret


def test_config_secrets_lists_every_secret_value() -> None:
    cfg = parse({
        "http": {"api_keys": ["client-key-1", "client-key-2"], "admin_api_key": "the-admin-key"},
        "redis": {"url": "redis://:url-redis-pw@127.0.0.1:6379/0", "password": "cfg-redis-pw"},
        "fleets": [
            {"name": "s", "model": "m", "engine": "static", "urls": ["http://u:engine-pw@127.0.0.1:1"]},
            {"name": "v", "model": "v", "engine": "vllm", "env": {"HF_TOKEN": "hf-token-value", "X": "plain"},
             "engine_args": {"hf-token": "engine-hf-token", "max-num-seqs": 8}},
            {"name": "k", "model": "k", "engine": "static", "urls": ["http://127.0.0.1:2"],
             "api_key": "env:ENGINE_KEY"},
        ],
    }, environ={"ENGINE_KEY": "engine-api-key"})
    assert sorted(config.secret_values(cfg)) == sorted([
        "client-key-1", "client-key-2", "the-admin-key", "url-redis-pw", "cfg-redis-pw", "engine-pw",
        "hf-token-value", "engine-hf-token", "engine-api-key"])


def test_redactor_masks_known_values_names_and_nested_values() -> None:
    r = redact.Redactor()
    r.learn(["the-admin-key", "abc"])  # too short to mask in free text: left alone
    event = r(None, "info", {
        "event": "reload with the-admin-key",
        "running": "redis://:pw1234@h:1/0",
        "recorded": {"env": {"HF_TOKEN": "hf-xyz"}, "engine_args": {"max-num-seqs": 8}},
        "problems": ["$.http.admin_api_key: the-admin-key is wrong", "abc"],
        "api_keys": ["k1", "k2"],
        "count": 3,
    })
    assert event == {
        "event": "reload with ***",
        "running": "redis://:***@h:1/0",
        "recorded": {"env": {"HF_TOKEN": "***"}, "engine_args": {"max-num-seqs": 8}},
        "problems": ["$.http.admin_api_key: *** is wrong", "abc"],
        "api_keys": "***",
        "count": 3,
    }


def test_shown_masks_secret_keys_and_url_passwords() -> None:
    assert redact.shown("password", "pw") == "***"
    assert redact.shown("password", "") == ""
    assert redact.shown("url", "redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact.shown("port", 8080) == 8080


def test_argv_masks_secret_flags() -> None:
    """The engine log's first line is its command line: vLLM's own --api-key must not be in it."""
    argv = ["vllm", "serve", "/models/x", "--api-key", "engine-key-1", "--hf-token=hf-2", "--port", "8001",
            "--max-num-seqs", "64", "--kv-transfer-config", "http://u:pw-3@h:1"]
    assert redact.argv(argv) == ["vllm", "serve", "/models/x", "--api-key", "***", "--hf-token=***",
                                 "--port", "8001", "--max-num-seqs", "64", "--kv-transfer-config",
                                 "http://u:***@h:1"]


_FIELD_NAMES = st.sampled_from(["event", "request_id", "model", "status", "api_key", "token", "url",
                                "max_tokens", "password", "instance", "level"])
_TEXT = st.text(alphabet=st.sampled_from(list("ab@=: /Brearsic0123")), max_size=24) | st.sampled_from(
    ["Bearer abcd1234", "Basic dXNlcjpw", "http://u:pw@h:1", "x?token=t", "the-secret-key"])
_VALUES = _TEXT | st.integers() | st.floats(allow_nan=False) | st.booleans() | st.none() | st.lists(_TEXT)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(event=st.dictionaries(_FIELD_NAMES, _VALUES, max_size=8), secrets=st.booleans())
def test_the_whole_line_shortcut_masks_what_field_by_field_masks(event: dict[str, object],
                                                                 secrets: bool) -> None:
    """Every log line first takes a shortcut (all fields at once); it must mask exactly what the
    field-by-field walk masks, or a secret would reach the log."""
    r = redact.Redactor()
    if secrets:
        r.learn(["the-secret-key", "abcd1234"])
    assert r(None, "info", dict(event)) == {k: r.value(k, v) for k, v in event.items()}


@pytest.mark.parametrize(("said", "shown"), [
    ("b'GET /v1/models?key=sk-k1&model=m HTTP/1.1 junk'",
     "b'GET /v1/models?key=***&model=*** HTTP/1.1 junk'"),
    ("b'GET /x?sk-bare-k2 HTTP/9'", "b'GET /x?*** HTTP/9'"),
    ("Invalid header value char:\n\n  b'X-Api-Key: sk-k3\\x01zz'",
     "Invalid header value char:\n\n  b'X-Api-Key: ***'"),
    ("Invalid header token:\n\n  b'X-Api-Key sk-k4'", "Invalid header token:\n\n  b'X-Api-Key ***'"),
    ("b'Authorization: Bearer sk-k5\\x01'", "b'Authorization: ***'"),
    ("Bad status line: Expected HTTP/, RTSP/ or ICE/:", "Bad status line: Expected HTTP/, RTSP/ or ICE/:"),
    ("b'Host: example.org'", "b'Host: example.org'"),
])
def test_a_request_head_is_shown_without_query_values_or_secret_headers(said: str, shown: str) -> None:
    assert redact.request_head(said) == shown
