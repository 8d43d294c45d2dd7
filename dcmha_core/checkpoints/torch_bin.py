"""torch.save zip archives (pytorch_model*.bin), read and written without torch.

An archive holds ``<prefix>/data.pkl`` (the pickled state dict), ``<prefix>/byteorder`` and
one record ``<prefix>/data/<key>`` per storage. The pickle is read by `_PickleMachine`, a
small pickle virtual machine of our own that knows the opcodes torch.save writes
(protocols 2 to 5) and builds nothing but strings, numbers, tuples, lists, dicts and the
tensors of the allow-listed rebuild functions: it runs no code, hashes no key but a string,
formats no unbounded value, and bounds nesting. Storages are checked against their records
(size, dtype) before a byte is read, views against their storage, and the archive's records
against the archive's size (a cap on how much they may inflate).
"""

from __future__ import annotations

import collections
import gc
import math
import os
import re
import struct
import zipfile
import zlib

import numpy as np

from dcmha.checkpoints.files import (MAX_DIM, MAX_RANK, bfloat16_to_float32, is_int, label,
                                      short)

#: torch storage classes -> NumPy dtype of their elements ("bfloat16": uint16 words,
#: widened to float32 when read, since NumPy has no bfloat16).
TORCH_STORAGES = {"FloatStorage": "float32", "DoubleStorage": "float64",
                  "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
                  "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
                  "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}
#: The records of an archive may inflate to at most this many times the archive's size
#: (torch stores them uncompressed: 1x), plus INFLATE_SLACK bytes.
INFLATE_RATIO, INFLATE_SLACK = 16, 1 << 20
#: The tensors rebuilt from an archive may hold at most this many times its records' bytes
#: (bfloat16 widens 2x; views such as the official qkw_m copy part of a storage again).
REBUILD_RATIO = 8
#: The deepest nesting of tuples, lists and dicts, and the most pickle stack marks.
MAX_NESTING = 32
#: The largest data.pkl read, and the most values its pickle may hold at once on its stack
#: or in its memo, or build as containers (about 13 per tensor: a state dict of up to 20k
#: tensors; the official 7B checkpoints hold about 600).
MAX_PICKLE_BYTES, MAX_VALUES = 64 << 20, 1 << 18
_KEY = re.compile(r"^[A-Za-z0-9_.]{1,64}$")


class _StorageType:
    """A torch storage class named by the pickle: its element dtype."""

    def __init__(self, dtype):
        self.dtype = dtype


_STORAGE_TYPES = {name: _StorageType(dtype) for name, dtype in TORCH_STORAGES.items()}


class _Storage:
    """One storage of an archive: its record, checked to hold numel elements of dtype,
    read (and bfloat16 widened) on first use."""

    def __init__(self, reader, record, dtype, numel):
        self.reader, self.record, self.dtype, self.numel = reader, record, dtype, numel
        self._data = None

    def data(self) -> np.ndarray:
        if self._data is None:
            raw = self.reader.read_record(self.record)
            words = np.frombuffer(raw, "<u2" if self.dtype == "bfloat16"
                                  else np.dtype(self.dtype).newbyteorder("<"))
            self._data = bfloat16_to_float32(words) if self.dtype == "bfloat16" else \
                words.astype(words.dtype.newbyteorder("="), copy=False)
        return self._data


class _Tensor:
    """A tensor rebuilt by the allow-listed functions (its NumPy array): what every value of
    a state dict must be, told apart from any other value the pickle builds."""

    def __init__(self, array):
        self.array = array


class _Reader:
    """The archive of one .bin file: its records, the storages named by the pickle, and the
    budget of bytes that rebuilding tensors may still use."""

    def __init__(self, archive: zipfile.ZipFile, prefix: str, name: str, budget: int):
        self.archive, self.prefix, self.name, self.budget = archive, prefix, name, budget
        self.storages = {}

    def fail(self, message):
        raise ValueError(f"{self.name}: {message}")

    def read_record(self, record) -> bytes:
        try:
            return self.archive.read(record)
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError,
                RuntimeError) as err:
            self.fail(f"record {short(record)} cannot be read ({type(err).__name__}: "
                      f"{str(err)[:120]}).")

    def storage(self, pid) -> _Storage:
        """persistent_load: ('storage', storage class, key, location, numel)."""
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)
                or not isinstance(pid[3], str) or not is_int(pid[4])):
            self.fail(f"unsupported persistent id {short(pid)} (expected ('storage', a torch "
                      "storage class, key, location, numel)).")
        _, kind, key, _location, numel = pid
        if not _KEY.match(key):
            self.fail(f"storage key {short(key)} is not a plain record name.")
        if not 0 <= numel <= MAX_DIM:
            self.fail(f"storage {key!r} declares {short(numel)} elements.")
        known = self.storages.get(key)
        if known is not None:
            if (known.dtype, known.numel) != (kind.dtype, numel):
                self.fail(f"storage {key!r} is named as {known.numel} {known.dtype} and as "
                          f"{numel} {kind.dtype} elements.")
            return known
        record = f"{self.prefix}data/{key}"
        try:
            size = self.archive.getinfo(record).file_size
        except KeyError:
            self.fail(f"storage {key!r} has no record {record!r}.")
        itemsize = 2 if kind.dtype == "bfloat16" else np.dtype(kind.dtype).itemsize
        if size != numel * itemsize:
            self.fail(f"storage {key!r} declares {numel} {kind.dtype} elements ("
                      f"{numel * itemsize} bytes); its record holds {size} bytes.")
        self.storages[key] = _Storage(self, record, kind.dtype, numel)
        return self.storages[key]

    def rebuild(self, storage, offset, size, stride, *_rest) -> _Tensor:
        """torch._utils._rebuild_tensor_v2: a strided view of the storage, copied, after
        checking that it lies inside the storage and holds no more elements than it."""
        if not isinstance(storage, _Storage):
            self.fail(f"a tensor is rebuilt from a {type(storage).__name__}, not a storage.")
        if not (is_int(offset) and isinstance(size, tuple) and isinstance(stride, tuple)
                and len(size) == len(stride) <= MAX_RANK
                and all(is_int(n) and 0 <= n <= MAX_DIM for n in size + stride)
                and 0 <= offset <= MAX_DIM):
            self.fail(f"tensor view (offset {short(offset)}, size {short(size)}, stride "
                      f"{short(stride)}) is not non-negative integers of at most {MAX_RANK} "
                      "axes.")
        numel = math.prod(size)
        where = f"tensor view (offset {offset}, size {size}, stride {stride})"
        if numel and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.numel:
            self.fail(f"{where} lies outside its storage of {storage.numel} elements.")
        if numel > storage.numel:
            self.fail(f"{where} holds {numel} elements, more than its storage's "
                      f"{storage.numel} (overlapping strides are not supported).")
        nbytes = numel * (4 if storage.dtype == "bfloat16" else np.dtype(storage.dtype).itemsize)
        self.budget -= nbytes
        if self.budget < 0:
            self.fail(f"its tensors hold more than {REBUILD_RATIO} times the bytes of its "
                      "records (views copying their storages over and over).")
        data = storage.data()
        if not numel:
            return _Tensor(np.zeros(size, data.dtype))
        return _Tensor(np.lib.stride_tricks.as_strided(
            data[offset:], shape=size, strides=tuple(s * data.itemsize for s in stride)).copy())


def _rebuild_parameter(data, *_rest):
    return data


_ORDERED_DICT = collections.OrderedDict


class _PickleMachine:
    """The pickle opcodes torch.save writes, over the bytes of data.pkl: values are built
    on a stack as pickle does; globals resolve to OrderedDict, the two rebuild functions
    and the storage classes only. Anything else raises a ValueError naming the file."""

    _GLOBALS = {("collections", "OrderedDict"): _ORDERED_DICT,
                ("torch._utils", "_rebuild_tensor_v2"): "rebuild",
                ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}

    def __init__(self, data: bytes, reader: _Reader):
        self.data, self.reader, self.pos = data, reader, 0
        self.stack, self.marks, self.memo, self.depth = [], [], {}, {}
        self.made = 0    # containers built and memo entries written: at most MAX_VALUES

    def fail(self, message):
        self.reader.fail(f"{message} (data.pkl, byte {self.pos})")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            self.fail("the pickle is cut short")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos, self.pos + 256)
        if end < 0:
            self.fail("a global's name is not a short line")
        text = self.data[self.pos:end]
        self.pos = end + 1
        try:
            return text.decode("ascii")
        except UnicodeDecodeError:
            self.fail("a global's name is not ASCII")

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def text(self, n: int) -> str:
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            self.fail("a string is not UTF-8")

    def pop(self):
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            self.fail("the pickle stack is empty")
        return self.stack.pop()

    def pop_mark(self) -> list:
        if not self.marks:
            self.fail("no MARK for a sequence opcode")
        at = self.marks.pop()
        items, self.stack[at:] = self.stack[at:], []
        return items

    def count(self):
        self.made += 1
        if self.made > MAX_VALUES:
            self.fail(f"the pickle builds more than {MAX_VALUES} values")

    def nest(self, container, items):
        """Record container's depth (1 + its deepest item's) and refuse deep nesting. The
        table keeps each container alive, so that an id is never reused while listed."""
        if id(container) not in self.depth:
            self.count()
        deepest = max((self.depth.get(id(v), (None, 0))[1] for v in items), default=0)
        d = max(self.depth.get(id(container), (None, 1))[1], deepest + 1)
        if d > MAX_NESTING:
            self.fail(f"values nested more than {MAX_NESTING} deep")
        self.depth[id(container)] = (container, d)
        return container

    def push_tuple(self, items):
        self.stack.append(self.nest(tuple(items), items))

    def set_items(self, target, items):
        if not isinstance(target, dict) or len(items) % 2:
            self.fail(f"SETITEM(S) on a {type(target).__name__}")
        for k, v in zip(items[::2], items[1::2]):
            if not isinstance(k, str):
                self.fail(f"a dict key is a {type(k).__name__}, not a string")
            if k in target:
                self.fail(f"the key {short(k)} appears twice")
            target[k] = v
        self.nest(target, items[1::2])

    def append(self, target, items):
        if not isinstance(target, list):
            self.fail(f"APPEND(S) on a {type(target).__name__}")
        target.extend(items)
        self.nest(target, items)

    def resolve(self, module: str, name: str):
        if (module, name) in self._GLOBALS:
            found = self._GLOBALS[(module, name)]
            return self.reader.rebuild if found == "rebuild" else found
        if module == "torch" and name in _STORAGE_TYPES:
            return _STORAGE_TYPES[name]
        self.reader.fail(f"refusing to unpickle the global '{short(module)[1:-1]}."
                         f"{short(name)[1:-1]}' (a weights-only checkpoint holds tensors, not "
                         "objects).")

    def reduce(self):
        args, fn = self.pop(), self.pop()
        if not isinstance(args, tuple):
            self.fail("REDUCE's arguments are not a tuple")
        if fn is _ORDERED_DICT and not args:
            self.stack.append(_ORDERED_DICT())
        elif fn is _rebuild_parameter and 1 <= len(args) <= 4 and isinstance(args[0], _Tensor):
            self.stack.append(args[0])
        elif fn == self.reader.rebuild and 4 <= len(args) <= 7:
            self.stack.append(self.reader.rebuild(*args))
        else:
            self.fail(f"unsupported call of {getattr(fn, '__name__', type(fn).__name__)} with "
                      f"{len(args)} arguments")

    def build(self):
        state, target = self.pop(), self.stack[-1] if self.stack else None
        # torch.save's OrderedDict carries its `_metadata` (module versions) as state.
        if not isinstance(target, dict) or not isinstance(state, dict):
            self.fail("BUILD other than an OrderedDict's metadata")

    def get(self, key):
        if key not in self.memo:
            self.fail(f"memo entry {key} read before it is written")
        self.stack.append(self.memo[key])

    def put(self, key):
        if not self.stack:
            self.fail("the pickle stack is empty")
        if key not in self.memo:
            self.count()
        self.memo[key] = self.stack[-1]

    def load(self):
        """The pickle's value. The cyclic garbage collector is paused meanwhile: it would
        walk the containers kept in the depth table again and again (they hold no cycles
        that need it)."""
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if paused:
                gc.enable()

    def _run(self):
        ops = self._ops()
        while True:
            code = self.take(1)[0]
            if code == 0x2E:                                   # STOP
                return self.pop()
            op = ops.get(code)
            if op is None:
                self.pos -= 1
                self.fail(f"unsupported pickle opcode 0x{code:02x}")
            op()
            if len(self.stack) > MAX_VALUES:
                self.fail(f"more than {MAX_VALUES} values on the pickle stack")

    def _ops(self) -> dict:
        s, push = self.stack, self.stack.append

        def proto():
            if self.take(1)[0] > 5:
                self.fail("pickle protocol above 5")

        def mark():
            if len(self.marks) >= MAX_NESTING:
                self.fail(f"more than {MAX_NESTING} open MARKs")
            self.marks.append(len(s))

        def stack_global():
            name, module = self.pop(), self.pop()
            if not isinstance(module, str) or not isinstance(name, str):
                self.fail("STACK_GLOBAL of non-strings")
            push(self.resolve(module, name))

        def pid():
            push(self.reader.storage(self.pop()))

        def long_(n):
            if n > 16:
                self.fail(f"an integer of {n} bytes")
            return int.from_bytes(self.take(n), "little", signed=True)

        def new_dict():
            d = {}
            self.count()
            self.depth[id(d)] = (d, 1)
            push(d)

        def new_list():
            lst = []
            self.count()
            self.depth[id(lst)] = (lst, 1)
            push(lst)

        def dict_from_mark():
            d = {}
            self.count()
            self.depth[id(d)] = (d, 1)
            self.set_items(d, self.pop_mark())
            push(d)

        def list_from_mark():
            lst = []
            self.count()
            self.depth[id(lst)] = (lst, 1)
            self.append(lst, self.pop_mark())
            push(lst)

        return {
            0x80: proto, 0x95: lambda: self.take(8),           # PROTO, FRAME
            0x28: mark, 0x31: self.pop_mark,                   # MARK, POP_MARK
            0x30: self.pop, 0x32: lambda: push(s[-1] if s else self.fail("DUP of nothing")),
            0x29: lambda: self.push_tuple(()),                 # EMPTY_TUPLE
            0x74: lambda: self.push_tuple(self.pop_mark()),    # TUPLE
            0x85: lambda: self.push_tuple([self.pop()]),       # TUPLE1
            0x86: lambda: self.push_tuple(list(reversed([self.pop(), self.pop()]))),
            0x87: lambda: self.push_tuple(list(reversed([self.pop(), self.pop(), self.pop()]))),
            0x5D: new_list, 0x6C: list_from_mark,              # EMPTY_LIST, LIST
            0x61: lambda: self.append(s[-2] if len(s) > 1 else None, [self.pop()]),
            0x65: lambda: self.append(s[self.marks[-1] - 1]
                                      if self.marks and self.marks[-1] else None,
                                      self.pop_mark()),        # APPENDS
            0x7D: new_dict, 0x64: dict_from_mark,              # EMPTY_DICT, DICT
            0x73: lambda: self.set_items(s[-3] if len(s) > 2 else None,
                                         list(reversed([self.pop(), self.pop()]))),
            0x75: lambda: self.set_items(s[self.marks[-1] - 1]
                                         if self.marks and self.marks[-1] else None,
                                         self.pop_mark()),     # SETITEMS
            0x4E: lambda: push(None), 0x88: lambda: push(True), 0x89: lambda: push(False),
            0x4A: lambda: push(int.from_bytes(self.take(4), "little", signed=True)),
            0x4B: lambda: push(self.uint(1)), 0x4D: lambda: push(self.uint(2)),
            0x8A: lambda: push(long_(self.uint(1))), 0x8B: lambda: push(long_(self.uint(4))),
            0x47: lambda: push(struct.unpack(">d", self.take(8))[0]),   # BINFLOAT
            0x58: lambda: push(self.text(self.uint(4))),       # BINUNICODE
            0x8C: lambda: push(self.text(self.uint(1))),       # SHORT_BINUNICODE
            0x8D: lambda: push(self.text(self.uint(8))),       # BINUNICODE8
            0x43: lambda: push(self.take(self.uint(1))),       # SHORT_BINBYTES
            0x42: lambda: push(self.take(self.uint(4))),       # BINBYTES
            0x63: lambda: push(self.resolve(self.line(), self.line())),   # GLOBAL
            0x93: stack_global, 0x52: self.reduce, 0x62: self.build, 0x51: pid,
            0x71: lambda: self.put(self.uint(1)), 0x72: lambda: self.put(self.uint(4)),
            0x94: lambda: self.put(len(self.memo)),            # BINPUT, LONG_BINPUT, MEMOIZE
            0x68: lambda: self.get(self.uint(1)), 0x6A: lambda: self.get(self.uint(4)),
        }


def _open_archive(path, name):
    """The archive, its single '<prefix>/data.pkl' record's prefix; the records checked
    for duplicates and against the inflation cap."""
    archive = zipfile.ZipFile(path)
    infos = archive.infolist()
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{name}: the record {short(dup)} appears twice in the archive.")
    cap = INFLATE_RATIO * os.path.getsize(path) + INFLATE_SLACK
    total = sum(i.file_size for i in infos)
    if total > cap:
        raise ValueError(f"{name}: its records inflate to {total} bytes, more than "
                         f"{INFLATE_RATIO} times the archive's size.")
    pickles = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise ValueError(f"{name}: expected one '<archive>/data.pkl' record, found "
                         f"{short(pickles)}.")
    return archive, pickles[0][:-len("data.pkl")], total


def read_torch_bin(path) -> dict:
    """The state dict of a `torch.save` zip archive (pytorch_model*.bin) as NumPy arrays.

    Weights only and without torch: the pickle may name nothing but
    ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2`` /
    ``_rebuild_parameter`` and torch's storage classes; anything else raises a
    ValueError naming the file and the global. Views (e.g. the official
    ``qkw_m``, a view of ``qkw``) are read through their offset and strides.
    bfloat16 storages come back as float32 (exact). Every value must be a tensor,
    every key a string; a malformed archive raises a ValueError naming the file.
    """
    path = os.fspath(path)
    name = label(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{name}: not a torch zip archive (torch.save's legacy non-zip format "
                         "is not supported; re-save it with a current torch).")
    try:
        archive, prefix, total = _open_archive(path, name)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError,
            UnicodeDecodeError) as err:
        raise ValueError(f"{name}: not a readable zip archive ({type(err).__name__}: "
                         f"{str(err)[:120]}).") from None
    with archive:
        reader = _Reader(archive, prefix, name, REBUILD_RATIO * total + INFLATE_SLACK)
        if prefix + "byteorder" in archive.namelist():
            order = reader.read_record(prefix + "byteorder")[:16].decode("ascii", "replace")
            if order.strip() != "little":
                reader.fail(f"byte order {short(order.strip())}; only little-endian is "
                            "supported.")
        size = archive.getinfo(prefix + "data.pkl").file_size
        if size > MAX_PICKLE_BYTES:
            reader.fail(f"data.pkl holds {size} bytes; at most {MAX_PICKLE_BYTES} are read.")
        result = _PickleMachine(reader.read_record(prefix + "data.pkl"), reader).load()
    if not isinstance(result, dict):
        raise ValueError(f"{name}: holds a {type(result).__name__}, not a state dict.")
    for key, value in result.items():
        if not isinstance(value, _Tensor):
            raise ValueError(f"{name}: entry {short(key)} is a {type(value).__name__}, not a "
                             "tensor (a state dict maps names to tensors).")
    return {k: v.array for k, v in result.items()}


_STORAGE_OF = {v: k for k, v in TORCH_STORAGES.items()}


def _pickle_int(n: int) -> bytes:
    if -2**31 <= n < 2**31:
        return b"J" + int(n).to_bytes(4, "little", signed=True)
    raw = int(n).to_bytes((int(n).bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw                       # LONG1


def _pickle_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return b"X" + len(raw).to_bytes(4, "little") + raw             # BINUNICODE


def _pickle_tuple(items) -> bytes:
    return b"(" + b"".join(items) + b"t"                           # MARK ... TUPLE


_PICKLED_ORDERED_DICT = b"ccollections\nOrderedDict\n)R"           # GLOBAL, (), REDUCE


def write_torch_bin(path, tensors: dict, views: dict) -> None:
    """A torch.save-compatible zip archive of NumPy arrays, written without torch.

    tensors: {name: (array in its storage dtype, dtype name)}; views: {name: (base
    name, offset, shape, stride)} share the base's storage, as torch views do.
    The pickle is assembled opcode by opcode (protocol 2), so that it names
    torch's globals without importing torch.
    """
    keys = {name: str(i) for i, name in enumerate(tensors)}
    body = [b"\x80\x02", _PICKLED_ORDERED_DICT]

    def tensor(base, offset, shape, stride):
        data, dtype = tensors[base]
        storage = _pickle_tuple([_pickle_str("storage"),
                                 f"ctorch\n{_STORAGE_OF[dtype]}\n".encode(),
                                 _pickle_str(keys[base]), _pickle_str("cpu"),
                                 _pickle_int(data.size)])
        return (b"ctorch._utils\n_rebuild_tensor_v2\n"
                + _pickle_tuple([storage + b"Q", _pickle_int(offset),
                                 _pickle_tuple(_pickle_int(n) for n in shape),
                                 _pickle_tuple(_pickle_int(s) for s in stride),
                                 b"\x89", _PICKLED_ORDERED_DICT]) + b"R")

    for name, (data, _) in tensors.items():
        stride = [s // data.itemsize for s in data.strides] if data.size else [1] * data.ndim
        body.append(_pickle_str(name) + tensor(name, 0, data.shape, stride) + b"s")
    for name, (base, offset, shape, stride) in views.items():
        body.append(_pickle_str(name) + tensor(base, offset, shape, stride) + b"s")
    body.append(b".")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"".join(body))
        z.writestr("archive/byteorder", "little")
        for name, (data, dtype) in tensors.items():
            z.writestr(f"archive/data/{keys[name]}",
                       np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes())
        z.writestr("archive/version", "3\n")
