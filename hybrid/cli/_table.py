"""A plain-text table: enough for a terminal, no dependency."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned.

    >>> print(format_table(["a", "bb"], [[1, "x"], [22, "yy"]]))
     a  bb
    --  --
     1  x
    22  yy
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(headers))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def human_bytes(n: float) -> str:
    """Bytes in binary units.

    >>> human_bytes(3 << 20)
    '3.00 MiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
