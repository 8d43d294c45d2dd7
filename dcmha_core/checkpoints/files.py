"""What the checkpoint readers share: limits on untrusted files, bounded messages, JSON
files read under size and depth limits, and the bfloat16 / float8 conversions.

Every reader treats its file as untrusted: sizes are compared with the file before
anything is allocated, nesting is bounded, and a bad file raises a ValueError whose
message starts with the file's name (an OSError when the file cannot be read at all).
"""

from __future__ import annotations

import json
import os
import reprlib

import numpy as np

#: The largest JSON file read (config.json, index files, tokenizer.json, headers).
MAX_JSON_BYTES = 64 << 20
#: The deepest nesting of arrays / objects accepted in a JSON file.
MAX_JSON_DEPTH = 32
#: The most axes a tensor may have, and the largest size of one axis.
MAX_RANK = 32
MAX_DIM = 1 << 48

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def short(value) -> str:
    """A repr of `value` for an error message, bounded in length and in the work done
    (at most a few items at two levels, whatever the value's size or nesting)."""
    try:
        return _REPR.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too long for str(): name its type
        return f"<{type(value).__name__}>"


def is_int(v) -> bool:
    """An integer, bools excluded."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def label(path) -> str:
    """The name a message gives a file: its base name."""
    return os.path.basename(os.fspath(path))


def _nesting_exceeds(value, limit: int) -> bool:
    """Whether arrays / objects nest more than `limit` deep in a parsed JSON value (an
    explicit stack: linear in the value's size, no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((item, depth + 1) for item in (v.values() if isinstance(v, dict)
                                                        else v))
    return False


def parse_json(raw: bytes, name: str, what: str = "JSON"):
    """JSON text (bytes) as Python values; ValueError naming `name` for anything but
    UTF-8 JSON nested at most MAX_JSON_DEPTH deep."""
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{name}: {len(raw)} bytes of {what}; at most {MAX_JSON_BYTES} are "
                         "read.")
    deep = ValueError(f"{name}: {what} nested more than {MAX_JSON_DEPTH} levels deep.")
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: not UTF-8 text (byte {err.start}).") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: not valid {what} ({err.msg} at line {err.lineno}, column "
                         f"{err.colno}).") from None
    except RecursionError:   # the parser's own depth guard (Python's recursion limit)
        raise deep from None
    except ValueError as err:   # e.g. an integer of too many digits
        raise ValueError(f"{name}: not valid {what} ({str(err)[:120]}).") from None
    if _nesting_exceeds(value, MAX_JSON_DEPTH):
        raise deep
    return value


def read_json(path, what: str = "JSON"):
    """A JSON file's value (see `parse_json`); the size is checked before it is read."""
    name = label(path)
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{name}: {size} bytes; a {what} file is read only up to "
                         f"{MAX_JSON_BYTES} bytes.")
    with open(path, "rb") as f:
        return parse_json(f.read(MAX_JSON_BYTES + 1), name, what)


def read_json_object(path, what: str = "JSON") -> dict:
    """`read_json` for a file that must hold a JSON object."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise ValueError(f"{label(path)}: a {what} file holds a JSON object; this one holds a "
                         f"{type(value).__name__}.")
    return value


def bfloat16_to_float32(words: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32: bfloat16 is the top half of a float32."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _e4m3fn_table() -> np.ndarray:
    """float32 value of every float8_e4m3fn byte: exponent bias 7, no infinities,
    0x7f / 0xff NaN."""
    b = np.arange(256)
    sign = np.where(b >> 7, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    value = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    value = np.where((e == 15) & (m == 7), np.nan, value)
    return (sign * value).astype(np.float32)


_E4M3FN = _e4m3fn_table()


def float8_to_float32(raw: np.ndarray, kind: str) -> np.ndarray:
    """float8 bytes (uint8) -> float32, exact: "e5m2" is the top byte of a float16,
    "e4m3fn" is read through its 256-entry table."""
    if kind == "e5m2":
        return (raw.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    return _E4M3FN[raw]
