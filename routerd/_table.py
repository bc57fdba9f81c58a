"""A plain right-aligned text table on stdout: ``routerd usage`` prints one, and so does every benchmark.

It lives in the runtime package, not in the benchmarks, so a production command needs no benchmark code.
"""

from __future__ import annotations

import math
from typing import Any


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(c) for c in columns]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.2f}"
    return str(v)
