"""Byte counts as people write them: ``"6GiB"`` in, ``"1.5 KiB"`` out.

One place for units, so that a budget given on the command line, the size an OOM message says was requested and
every figure the guard prints agree.
"""

from __future__ import annotations

import re

__all__ = ["GiB", "MiB", "available_bytes", "format_bytes", "parse_bytes", "requested_bytes", "rounding_of_figures"]

MiB = 2**20
GiB = 2**30
_UNITS = {"": 1, "b": 1, "bytes": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": MiB,
          "g": 10**9, "gb": 10**9, "gib": GiB, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
# "Tried to allocate 2.00 GiB" (CUDA's caching allocator, SimulatedGPU) and "you tried to allocate 512 bytes" (the CPU).
_AVAILABLE = (
    re.compile(r"of which ([0-9.]+\s*(?:bytes|B|KiB|MiB|GiB|TiB)) is free"),
    re.compile(r"([0-9.]+\s*(?:bytes|B|KiB|MiB|GiB|TiB)) is reserved by PyTorch but unallocated"),
)
_REQUESTED = re.compile(r"(?:Tried to allocate|you tried to allocate)\s+([0-9.]+\s*(?:bytes|B|KiB|MiB|GiB|TiB))")


def format_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"unknown"``.

    >>> format_bytes(1536), format_bytes(6 * GiB), format_bytes(None)
    ('1.5 KiB', '6.0 GiB', 'unknown')
    """
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _size(text: str) -> int | None:
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        return None
    return int(float(match.group(1)) * _UNITS[unit])


def parse_bytes(value: int | str) -> int:
    """``"6GiB"`` -> ``6442450944``; ``"512 MB"`` -> ``512000000``; ints pass through.

    >>> parse_bytes("1.5KiB")
    1536
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"a memory size must be an int (bytes) or a string like '6GiB', got {value!r}")
    nbytes = value if isinstance(value, int) else _size(value)
    if nbytes is None:
        raise ValueError(
            f"cannot read {value!r} as a memory size: write a number and a unit, e.g. '6GiB', '512MiB', "
            f"'800MB' or a plain number of bytes"
        )
    if nbytes <= 0:
        raise ValueError(f"a memory budget must be positive, got {value!r}")
    return nbytes


def requested_bytes(message: str) -> int | None:
    """How much an out-of-memory message says was asked for, where it says.

    >>> requested_bytes("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...")
    2147483648
    """
    match = _REQUESTED.search(message)
    return _size(match.group(1)) if match else None


def available_bytes(message: str) -> int | None:
    """What an out-of-memory message says was still available: free device memory plus what the allocator held
    unallocated, where it says (None where it says neither).

    >>> available_bytes("... of which 1.50 MiB is free. ... and 2.00 MiB is reserved by PyTorch but unallocated.")
    3670016
    """
    sizes = [_size(match.group(1)) for pattern in _AVAILABLE for match in [pattern.search(message)] if match]
    known = [size for size in sizes if size is not None]
    return sum(known) if known else None


def rounding_of_figures(message: str) -> float:
    """How far, in bytes, the figures :func:`requested_bytes` and :func:`available_bytes` read from an out-of-memory
    message may lie from the sizes they were rounded from, together: half the unit of the last digit written, for
    each figure (``"4.0 MiB"``: 0.05 MiB; ``"512 B"``: half a byte). Figures that read equal, or within this, do not
    say which was larger.

    >>> rounding_of_figures("Tried to allocate 4.0 MiB. ... of which 4.0 MiB is free.") == 0.1 * MiB
    True
    """
    figures = [match.group(1) for match in [_REQUESTED.search(message)] if match]
    figures += [match.group(1) for pattern in _AVAILABLE for match in [pattern.search(message)] if match]
    return sum(_half_unit(figure) for figure in figures)


def _half_unit(text: str) -> float:
    """Half the unit of the last digit of a size as written (``"1.50 MiB"``: 0.005 MiB), in bytes; 0 where it
    cannot be read."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        return 0.0
    number = match.group(1)
    decimals = len(number.partition(".")[2])
    return 0.5 * 10.0**-decimals * _UNITS[unit]
