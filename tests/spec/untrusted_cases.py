"""Crafted files for the untrusted-input probes (tests/spec/test_untrusted_files.py): each
generator writes one malformed file (or directory) of a class that once crashed, hung,
allocated without bound or broke the error contract, and names the loader to run on it.

``CASES`` maps a case name to (generator, loader, the name its error must give); a
generator writes under the directory it is given and returns the path the loader takes.
The loaders run in a child process (``run_child``) with a memory limit and a per-case
alarm, which reports each case's error type, message and time as one JSON line.
"""

import io
import json
import os
import struct
import zipfile

import numpy as np

# ---------------------------------------------------------------------------
# Pickle opcodes, written by hand (protocol 2), and torch-style archives
# ---------------------------------------------------------------------------


def p_str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw                  # BINUNICODE


def p_int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n) if -2**31 <= n < 2**31 else \
        b"\x8a" + bytes([9]) + n.to_bytes(9, "little", signed=True)  # BININT / LONG1


def p_tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"                             # MARK ... TUPLE


ORDERED_DICT = b"ccollections\nOrderedDict\n)R"


def p_storage(key="0", numel=4, storage="FloatStorage") -> bytes:
    return p_tuple(p_str("storage"), f"ctorch\n{storage}\n".encode(), p_str(key), p_str("cpu"),
                   p_int(numel)) + b"Q"                              # BINPERSID


def p_tensor(storage: bytes, offset=0, size=(4,), stride=(1,)) -> bytes:
    return (b"ctorch._utils\n_rebuild_tensor_v2\n"
            + p_tuple(storage, p_int(offset), p_tuple(*map(p_int, size)),
                      p_tuple(*map(p_int, stride)), b"\x89", ORDERED_DICT) + b"R")


def state_dict_pickle(*entries: bytes) -> bytes:
    """An OrderedDict pickle of (key + value) entries, each followed by SETITEM."""
    return b"\x80\x02" + ORDERED_DICT + b"".join(e + b"s" for e in entries) + b"."


def bin_archive(path, pickle_bytes, records=None, compress=False, extra=()):
    """A torch.save-style zip: archive/data.pkl, byteorder, data/<key> records."""
    records = {"0": np.arange(4, dtype="<f4").tobytes()} if records is None else records
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", mode) as z:
        z.writestr("archive/data.pkl", pickle_bytes)
        z.writestr("archive/byteorder", "little")
        for key, raw in records.items():
            z.writestr(f"archive/data/{key}", raw)
        for name, raw in extra:
            z.writestr(name, raw)
    return path


def _bin(pickle_bytes, **kw):
    def make(d):
        return bin_archive(os.path.join(d, "pytorch_model.bin"), pickle_bytes, **kw)
    return make


def _memo_tuple_key(depth=60):
    # t0 = (); t_i = (t_{i-1}, t_{i-1}) through the memo: 2**depth leaves to hash.
    body = b")q\x00"
    for i in range(1, depth + 1):
        body += b"h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"\x86q" + bytes([i])
    return b"\x80\x02}" + body + p_int(1) + b"s."


def _self_sharing_list_pid(depth=60):
    # l_i = [l_{i-1}, l_{i-1}] through the memo, used as a persistent id: its repr is 2**depth.
    body = b"]q\x00"
    for i in range(1, depth + 1):
        body += b"](h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"eq" + bytes([i])
    return b"\x80\x02" + ORDERED_DICT + p_str("w") + body + b"Qs."


def _deep_tuples(depth=200_000):
    return b"\x80\x02" + ORDERED_DICT + p_str("w") + b")" + b"\x85" * depth + b"s."


def _zip_bomb(d, size=64 << 20):
    path = os.path.join(d, "pytorch_model.bin")
    return bin_archive(path, state_dict_pickle(p_str("w") + p_tensor(p_storage(numel=size // 4))),
                       records={"0": bytes(size)}, compress=True)


def _corrupt_record(d):
    path = _bin(state_dict_pickle(p_str("w") + p_tensor(p_storage())))(d)
    raw = bytearray(open(path, "rb").read())
    at = raw.find(np.arange(4, dtype="<f4").tobytes())
    raw[at + 5] ^= 0xFF                     # the record's bytes no longer match its CRC
    open(path, "wb").write(bytes(raw))
    return path


def _not_zip(d):
    path = os.path.join(d, "pytorch_model.bin")
    open(path, "wb").write(b"\x80\x02}q\x00." * 10)
    return path


def _duplicate_record(d):
    path = os.path.join(d, "pytorch_model.bin")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # zipfile warns about the duplicate name
        bin_archive(path, state_dict_pickle(p_str("w") + p_tensor(p_storage())),
                    extra=[("archive/data/0", b"\0" * 16)])
    return path


_T = p_tensor(p_storage())
BIN_CASES = {
    "bin_memo_tuple_key": _bin(_memo_tuple_key()),
    "bin_self_sharing_list_pid": _bin(_self_sharing_list_pid()),
    "bin_deep_nesting": _bin(_deep_tuples()),
    "bin_stride0_view": _bin(state_dict_pickle(p_str("w") + p_tensor(
        p_storage(), size=(300_000_000 // 4,), stride=(0,)))),
    "bin_shape_2_40": _bin(state_dict_pickle(p_str("w") + p_tensor(
        p_storage(), size=(2**40,), stride=(0,)))),
    "bin_view_outside_storage": _bin(state_dict_pickle(p_str("w") + p_tensor(
        p_storage(), offset=2, size=(4,)))),
    "bin_negative_stride": _bin(state_dict_pickle(p_str("w") + p_tensor(
        p_storage(), offset=3, size=(4,), stride=(-1,)))),
    "bin_numel_vs_record": _bin(state_dict_pickle(p_str("w") + p_tensor(
        p_storage(numel=1 << 30), size=(1 << 30,)))),
    "bin_forged_dtype_O": _bin(state_dict_pickle(p_str("w") + p_tensor(
        p_tuple(p_str("storage"), p_tuple(p_str("storage class"), p_str("O")), p_str("0"),
                p_str("cpu"), p_int(4)) + b"Q"))),
    "bin_forged_dtype_U1": _bin(state_dict_pickle(p_str("w") + p_tensor(
        p_tuple(p_str("storage"), p_tuple(p_str("storage class"), p_str("U1")), p_str("0"),
                p_str("cpu"), p_int(4)) + b"Q"))),
    "bin_storage_key_traversal": _bin(state_dict_pickle(p_str("w") + p_tensor(
        p_storage(key="../../x")))),
    "bin_missing_record": _bin(state_dict_pickle(p_str("w") + p_tensor(p_storage(key="7")))),
    "bin_zip_bomb": _zip_bomb,
    "bin_corrupt_record": _corrupt_record,
    "bin_not_zip": _not_zip,
    "bin_duplicate_record": _duplicate_record,
    "bin_two_pickles": _bin(state_dict_pickle(p_str("w") + _T),
                            extra=[("other/data.pkl", b".")]),
    "bin_non_tensor_value": _bin(state_dict_pickle(p_str("w") + p_int(3))),
    "bin_non_string_key": _bin(state_dict_pickle(p_int(3) + _T)),
    "bin_duplicate_key": _bin(state_dict_pickle(p_str("w") + _T, p_str("w") + _T)),
    "bin_build_empties_dict": _bin(b"\x80\x02" + ORDERED_DICT + p_str("w") + _T + b"s"
                                   + p_tuple(b"N", b"}") + b"b."),
    "bin_top_level_list": _bin(b"\x80\x02]" + _T + b"a."),
    "bin_global_os_system": _bin(b"\x80\x02cos\nsystem\n" + p_tuple(p_str("true")) + b"R."),
    "bin_stack_global_long_name": _bin(b"\x80\x04" + b"\x8c\x05torch" + p_str("x" * 100_000)
                                       + b"\x93."),
    "bin_unknown_opcode": _bin(b"\x80\x02(cos\nsystem\ni."),
    "bin_truncated": _bin(state_dict_pickle(p_str("w") + _T)[:-9]),
    "bin_bad_utf8": _bin(b"\x80\x02X\x02\x00\x00\x00\xff\xfe."),
    "bin_huge_long": _bin(b"\x80\x02\x8b\x00\x00\x10\x00" + b"\x01" * (1 << 20) + b"."),
    "bin_memo_missing": _bin(b"\x80\x02h\x05."),
    "bin_many_values": _bin(b"\x80\x02" + b"]0" * ((1 << 18) + 8) + b"N."),
    "bin_long_stack": _bin(b"\x80\x02" + b"N" * ((1 << 18) + 8) + b"."),
    "bin_stack_underflow": _bin(b"\x80\x02s."),
    "bin_reduce_bad_args": _bin(state_dict_pickle(
        p_str("w") + b"ctorch._utils\n_rebuild_tensor_v2\n"
        + p_tuple(p_storage(), p_int(0), p_int(4), p_int(1), b"\x89", ORDERED_DICT) + b"R")),
    "bin_ordered_dict_args": _bin(b"\x80\x02ccollections\nOrderedDict\n" + p_tuple(p_int(1))
                                  + b"R."),
}


def _big_endian(d):
    path = os.path.join(d, "pytorch_model.bin")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", state_dict_pickle(p_str("w") + _T))
        z.writestr("archive/byteorder", "big")
        z.writestr("archive/data/0", np.arange(4, dtype=">f4").tobytes())
    return path


BIN_CASES["bin_big_endian"] = _big_endian

# ---------------------------------------------------------------------------
# .safetensors headers
# ---------------------------------------------------------------------------

def safetensors_bytes(header, data=b"", length=None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _st(header, data=b"", length=None):
    def make(d):
        path = os.path.join(d, "model.safetensors")
        open(path, "wb").write(safetensors_bytes(header, data, length))
        return path
    return make


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


ST_CASES = {
    "st_short_file": lambda d: _write(d, "model.safetensors", b"\x01\x02"),
    "st_header_longer_than_file": _st({"w": _entry()}, bytes(8), length=1 << 40),
    "st_header_not_json": _st(b"{not json" + b" " * 7, bytes(8)),
    "st_header_not_utf8": _st(b"\xff\xfe" + b" " * 6),
    "st_header_a_list": _st([1, 2]),
    "st_header_deep": _st(b"[" * 100_000 + b"]" * 100_000),
    "st_unknown_dtype": _st({"w": _entry(dtype="C64")}, bytes(8)),
    "st_dtype_not_string": _st({"w": _entry(dtype=["F32"] * 10_000)}, bytes(8)),
    "st_negative_shape": _st({"w": _entry(shape=(-2,))}, bytes(8)),
    "st_shape_not_list": _st({"w": _entry(shape="2")}, bytes(8)),
    "st_size_vs_offsets": _st({"w": _entry(shape=(2**40,))}, bytes(8)),
    "st_offsets_outside": _st({"w": _entry(offsets=(0, 1 << 40))}, bytes(8)),
    "st_offsets_reversed": _st({"w": _entry(offsets=(8, 0))}, bytes(8)),
    "st_overlap": _st({"a": _entry(), "b": _entry()}, bytes(8)),
    "st_gap": _st({"a": _entry(offsets=(8, 16))}, bytes(16)),
    "st_missing_key": _st({"w": {"dtype": "F32", "shape": [2]}}, bytes(8)),
    "st_metadata_not_strings": _st({"__metadata__": {"a": [1]}, "w": _entry()}, bytes(8)),
    "st_entry_not_object": _st({"w": 3}, bytes(8)),
}


def _write(d, name, raw):
    path = os.path.join(d, name)
    open(path, "wb").write(raw)
    return path


# ---------------------------------------------------------------------------
# config.json, index files, tokenizer.json
# ---------------------------------------------------------------------------

def _file(name, raw):
    return lambda d: _write(d, name, raw if isinstance(raw, bytes) else json.dumps(raw).encode())


def _release_dir(config=None, tokenizer=None, index=None):
    """A directory with config.json (default: a small valid one), a tiny valid
    model.safetensors, and optionally tokenizer.json / an index file."""
    def make(d):
        cfg = dict(vocab_size=8, n_layer=1, n_head=2, dim=4, intermediate_size=8) \
            if config is None else config
        _write(d, "config.json", cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode())
        _write(d, "model.safetensors", safetensors_bytes({"w": _entry()}, bytes(8)))
        if tokenizer is not None:
            _write(d, "tokenizer.json", tokenizer)
        if index is not None:
            _write(d, "model.safetensors.index.json",
                   index if isinstance(index, bytes) else json.dumps(index).encode())
        return d
    return make


DIR_CASES = {
    "config_not_json": _release_dir(config=b"{'n_layer': 2}"),
    "config_deep": _release_dir(config=b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    "config_a_list": _release_dir(config=[1]),
    "config_string_size": _release_dir(config={"n_head": "4"}),
    "config_long_value": _release_dir(config={"window_type": "LX" * 1_000_000}),
    "config_huge_int": _release_dir(config=b'{"n_layer": ' + b"9" * 5000 + b"}"),
    "config_escaped_quotes": _release_dir(config=b'{"a": "' + b'\\"' * 2_000_000),
    "index_not_json": _release_dir(index=b"\x00\x01"),
    "index_no_weight_map": _release_dir(index={"metadata": {}}),
    "index_shard_not_string": _release_dir(index={"weight_map": {"w": 3}}),
    "index_shard_traversal": _release_dir(index={"weight_map": {"w": "../model.safetensors"}}),
    "index_deep": _release_dir(index=b"[" * 100_000 + b"]" * 100_000),
    "tokenizer_not_json": _release_dir(tokenizer=b"{\"model\": "),
    "tokenizer_not_a_tokenizer": _release_dir(tokenizer=b'{"model": {"type": "Nope"}}'),
    "tokenizer_deep": _release_dir(tokenizer=b'{"model":' + b"[" * 100_000 + b"]" * 100_000
                                   + b"}"),
}

#: The n_layer = 10**9 config: its table of expected names must not be built.
DIR_CASES["convert_n_layer_1e9"] = _release_dir(config={
    "vocab_size": 8, "n_layer": 10**9, "n_head": 2, "dim": 4, "intermediate_size": 8})


def convert_directory(d):
    """What `from_official_directory` does before building a model (no Keras needed)."""
    from dcmha.checkpoints import (load_official_state_dict, official_model_arguments,
                                   read_official_config)

    return official_model_arguments(load_official_state_dict(d), read_official_config(d))


def load_fixtures(d):
    from dcmha.conformance.cases import load_cases

    return load_cases(None, d)


# ---------------------------------------------------------------------------
# Conformance fixture folders
# ---------------------------------------------------------------------------

def _fixtures(manifest=None, case_json=None, npz=None):
    """A fixtures folder holding one case 'c' (c.json, c.npz) and a MANIFEST.json with
    their sha256 (or the manifest bytes given)."""
    import hashlib

    from dcmha.spec import reference

    def make(d):
        meta = {"name": "c", "description": "", "kind": "forward", "dtype": "float32",
                "config": {"num_heads": 2, "key_dim": 2}, "dims": {
                    "batch": 1, "query_length": 2, "key_length": 2, "query_input_dim": 4,
                    "key_input_dim": 4}, "call": {"use_causal_mask": False,
                                                  "self_attention": True},
                "requires": [], "outputs": ["output"],
                "tolerance": {"output": {"atol": 1e-5, "rtol": 1e-5}}}
        raw_json = case_json(meta) if case_json is not None else json.dumps(meta).encode()
        raw_npz = npz() if npz is not None else b"PK\x05\x06" + bytes(18)
        _write(d, "c.json", raw_json)
        _write(d, "c.npz", raw_npz)
        files = {n: hashlib.sha256(r).hexdigest() for n, r in (("c.json", raw_json),
                                                               ("c.npz", raw_npz))}
        _write(d, "MANIFEST.json", manifest if manifest is not None else json.dumps(
            {"spec_version": reference.SPEC_VERSION, "files": files}).encode())
        return d
    return make


def _npz_member_without_npy():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("input/query", b"not an array")
    return buf.getvalue()


def _npz_of_zeros(size=64 << 20):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("input/query.npy", _npy_header((size // 4,)) + bytes(size))
    return buf.getvalue()


def _npy_header(shape):
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<f4", "fortran_order": False,
                                               "shape": shape})
    return out.getvalue()


FIXTURE_CASES = {
    "manifest_deep": _fixtures(manifest=b'{"files": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    "case_config_missing_key": _fixtures(case_json=lambda m: json.dumps(
        {**m, "config": {"num_heads": 2}}).encode()),
    "case_config_unknown_key": _fixtures(case_json=lambda m: json.dumps(
        {**m, "config": {"num_heads": 2, "key_dim": 2, "bogus": 1}}).encode()),
    "npz_member_without_npy": _fixtures(npz=_npz_member_without_npy),
    "npz_inflated_zeros": _fixtures(npz=_npz_of_zeros),
}


# ---------------------------------------------------------------------------
# The child process: each case's loader under an alarm, one JSON line per case
# ---------------------------------------------------------------------------

#: case-name prefix -> loader (a dotted function taking the generated path)
LOADERS = {"bin_": "dcmha.checkpoints:read_torch_bin",
           "st_": "dcmha.checkpoints:read_safetensors",
           "config_": "dcmha.checkpoints:read_official_config",
           "index_": "dcmha.checkpoints:load_official_state_dict",
           "tokenizer_": "dcmha.hub._release:release_dir",
           "convert_": "untrusted_cases:convert_directory",
           "manifest_": "untrusted_cases:load_fixtures",
           "case_": "untrusted_cases:load_fixtures",
           "npz_": "untrusted_cases:load_fixtures"}

#: the name each error must contain
EXPECTED_NAME = {"bin_": "pytorch_model.bin", "st_": "model.safetensors",
                 "config_": "config.json", "index_": "model.safetensors.index.json",
                 "tokenizer_": "tokenizer.json", "convert_": "'n_layer'",
                 "manifest_": "MANIFEST.json",
                 "case_": "c.json", "npz_": "c.npz"}

ALL_CASES = {**BIN_CASES, **ST_CASES, **DIR_CASES, **FIXTURE_CASES}


def prefix_of(name):
    return next(p for p in LOADERS if name.startswith(p))


CHILD = r"""
import importlib, json, resource, signal, sys, time
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
jobs = json.loads(sys.argv[2])

class Alarm(BaseException):
    pass

def ring(*_):
    raise Alarm()

signal.signal(signal.SIGALRM, ring)
for name, loader, arg in jobs:
    module, fn = loader.split(":")
    fn = getattr(importlib.import_module(module), fn)
    start = time.perf_counter()
    signal.alarm(int(sys.argv[3]))
    try:
        fn(arg)
        kind, message = "returned", ""
    except Alarm:
        kind, message = "timeout", ""
    except BaseException as err:
        kind, message = type(err).__name__, str(err)[:2000]
    signal.alarm(0)
    print(json.dumps({"case": name, "error": kind, "message": message,
                      "seconds": time.perf_counter() - start}), flush=True)
"""
