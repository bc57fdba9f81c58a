"""The shared secret (routerd/trust.py): sealed records open only for the same secret and kind, and
the secret is loaded the same way by every process of one host."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from routerd import config as config_mod
from routerd.trust import Rejected, Trust, Why


def test_a_sealed_record_opens_for_its_kind_under_the_same_secret() -> None:
    a, b = Trust(b"s" * 32, source="config"), Trust(b"s" * 32, source="config")
    assert b.open("admin_call", a.seal("admin_call", b"drain f:0")) == b"drain f:0"
    assert a.engine_api_key == b.engine_api_key
    assert a.fingerprint == b.fingerprint


@pytest.mark.parametrize(("record", "why"), [
    (b"\x82\xa2op\xa5drain", Why.UNSIGNED),  # an XADD written by hand
    (b"", Why.UNSIGNED),
])
def test_an_unsigned_record_is_refused(record: bytes, why: Why) -> None:
    with pytest.raises(Rejected) as e:
        Trust(b"s" * 32, source="config").open("admin_call", record)
    assert e.value.why is why
    assert e.value.kind == "admin_call"


def test_a_record_from_another_secret_says_so() -> None:
    theirs = Trust(b"t" * 32, source="config").seal("fleet_state", b"{}")
    with pytest.raises(Rejected) as e:
        Trust(b"s" * 32, source="config").open("fleet_state", theirs)
    assert e.value.why is Why.OTHER_SECRET


def test_a_tampered_payload_or_another_kind_is_forged() -> None:
    trust = Trust(b"s" * 32, source="config")
    sealed = trust.seal("replicas", b'{"f": 3}')
    with pytest.raises(Rejected) as e:
        trust.open("replicas", sealed[:-2] + b"9}")
    assert e.value.why is Why.FORGED
    with pytest.raises(Rejected) as e:
        trust.open("admin_call", sealed)  # replayed as another kind of record
    assert e.value.why is Why.FORGED


def test_without_a_configured_secret_one_is_generated_once_and_kept(tmp_path: Path) -> None:
    first = Trust.load("", tmp_path)
    again = Trust.load("", tmp_path)
    assert first.engine_api_key == again.engine_api_key
    mode = stat.S_IMODE(os.stat(tmp_path / "secret").st_mode)
    assert mode == 0o600
    assert Trust.load("", tmp_path / "other").fingerprint != first.fingerprint


def test_the_secret_never_shows_in_repr() -> None:
    trust = Trust(b"very-secret-value-123", source="config")
    assert "very-secret" not in repr(trust)
    assert trust.fingerprint in repr(trust)


def test_config_takes_the_secret_from_the_environment_and_refuses_a_short_one() -> None:
    raw = {"control": {"secret": "env:RTD_TEST_SECRET"}}
    cfg = config_mod.parse(raw, {"RTD_TEST_SECRET": "x" * 20})
    assert cfg.control.secret == "x" * 20
    assert "x" * 20 in config_mod.secret_values(cfg)
    with pytest.raises(config_mod.ConfigError, match=r"\$\.control\.secret"):
        config_mod.parse({"control": {"secret": "short"}}, {})
    with pytest.raises(config_mod.ConfigError, match=r"\$\.control\.secret"):
        config_mod.parse(raw, {})
