"""The .safetensors format, read and written with NumPy alone.

A file is an 8-byte little-endian header length n, n bytes of JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the data, each tensor's bytes at [begin, end) of it (little-endian, row-major).
The reader checks the header as untrusted input: its length against the file, each
entry's dtype, shape and offsets, the byte count against the shape, and that the
entries tile the data exactly (no gap, no overlap, nothing after the last).
"""

from __future__ import annotations

import math
import os

import numpy as np

from dcmha.checkpoints.files import (MAX_DIM, MAX_JSON_BYTES, MAX_RANK, bfloat16_to_float32,
                                      float8_to_float32, is_int, label, parse_json, short)

#: safetensors dtype codes -> the dtype names the writer takes ("bfloat16": uint16 words).
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                      "U8": "uint8", "BOOL": "bool"}
#: Every code read: (storage dtype of the bytes, widening applied after reading, or None).
_READ = {**{code: (name, None) for code, name in SAFETENSORS_DTYPES.items()
            if code != "BF16"},
         "BF16": ("uint16", "bfloat16"), "U16": ("uint16", None), "U32": ("uint32", None),
         "U64": ("uint64", None), "F8_E4M3": ("uint8", "e4m3fn"), "F8_E5M2": ("uint8", "e5m2")}


def _entries(header, name: str, data_size: int) -> list:
    """(key, storage dtype, widening, shape, begin, end) of each tensor, checked."""
    if not isinstance(header, dict):
        raise ValueError(f"{name}: the header is a JSON {type(header).__name__}, not an object.")
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError(f"{name}: '__metadata__' must map strings to strings.")
            continue
        where = f"{name}: tensor {short(key)}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{where}: expected {{'dtype', 'shape', 'data_offsets'}}; received "
                             f"{short(info)}.")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str) or code not in _READ:
            raise ValueError(f"{where}: unsupported dtype {short(code)} (supported: "
                             f"{', '.join(sorted(_READ))}).")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(is_int(n) and 0 <= n <= MAX_DIM for n in shape)):
            raise ValueError(f"{where}: shape must be a list of at most {MAX_RANK} sizes in "
                             f"[0, 2**48]; received {short(shape)}.")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(is_int(n) for n in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise ValueError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= "
                             f"end <= {data_size} (the data's size); received {short(offsets)}.")
        dtype, widen = _READ[code]
        need = math.prod(shape) * np.dtype(dtype).itemsize
        if offsets[1] - offsets[0] != need:
            raise ValueError(f"{where}: shape {tuple(shape)} of {code} needs {need} bytes; "
                             f"data_offsets hold {offsets[1] - offsets[0]}.")
        entries.append((key, dtype, widen, tuple(shape), offsets[0], offsets[1]))
    at = 0
    for key, *_, begin, end in sorted(entries, key=lambda e: (e[4], e[5])):
        if begin != at:
            raise ValueError(f"{name}: tensor {short(key)} begins at byte {begin} of the data; "
                             f"the tensors before it end at {at} (the data must be tiled, no "
                             "gap and no overlap).")
        at = end
    if at != data_size:
        raise ValueError(f"{name}: the tensors end at byte {at} of the data, which holds "
                         f"{data_size}.")
    return entries


def read_safetensors(path) -> dict:
    """A .safetensors file as NumPy arrays. bfloat16, which NumPy lacks, and the float8
    types (F8_E4M3, F8_E5M2) are widened to float32 (exact); every other dtype is read
    as is. A malformed file raises a ValueError naming it and what is wrong."""
    path = os.fspath(path)
    name = label(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{name}: {size} bytes, shorter than the 8-byte header length of "
                             "a .safetensors file.")
        n = int.from_bytes(head, "little")
        if n > min(MAX_JSON_BYTES, size - 8):
            raise ValueError(f"{name}: header length {n} exceeds the file ({size} bytes) or "
                             f"the {MAX_JSON_BYTES}-byte limit.")
        header = parse_json(f.read(n), name, "safetensors header")
        out = {}
        for key, dtype, widen, shape, begin, end in _entries(header, name, size - 8 - n):
            f.seek(8 + n + begin)
            buf = bytearray(end - begin)
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{name}: tensor {short(key)} is cut short.")
            words = np.frombuffer(buf, np.dtype(dtype).newbyteorder("<"))
            if widen == "bfloat16":
                words = bfloat16_to_float32(words)
            elif widen is not None:
                words = float8_to_float32(words, widen)
            out[key] = words.astype(words.dtype.newbyteorder("="), copy=False).reshape(shape)
    return out


def write_safetensors(path, tensors: dict) -> None:
    """Write {name: (array in its storage dtype, dtype name of SAFETENSORS_DTYPES)}:
    the length, the JSON header (padded to 8 bytes) and the data, in order."""
    import json

    code = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for key, (data, dtype) in tensors.items():
        raw = np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes()
        header[key] = {"dtype": code[dtype], "shape": list(data.shape),
                       "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))
