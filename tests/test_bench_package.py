"""The benchmarks are a package beside routerd (``routerd_bench``), reached only by ``routerd bench``.

Why: the runtime must not need benchmark code (the import-linter contract in pyproject.toml keeps every
``routerd`` module off it), so the one command that does must say plainly when the package is missing,
and its help must name every benchmark there is.
"""

from __future__ import annotations

import sys

import pytest

import routerd_bench
from routerd import cli


def test_help_names_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("bench "))
    missing = [name for name in routerd_bench.BENCHMARKS if name not in line]
    assert not missing, line


def test_bench_without_a_name_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    for name in routerd_bench.BENCHMARKS:
        assert f"  {name} " in err


def test_a_missing_benchmark_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "routerd_bench", None)  # what `import` sees when it is not installed
    assert cli.main(["bench", "overhead"]) == 2
    assert "routerd_bench is not installed" in capsys.readouterr().err
