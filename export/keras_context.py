"""The state of one Keras export and the converter registry: ``Value`` (a graph value in
place of a KerasTensor), ``Context`` (the ModelBuilder, the layer path, the decode cache
plumbing), ``register_converter`` / ``converter_for``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import numpy as np
from onnx import TensorProto

import keras

from dcmha.export.builder import ModelBuilder


@dataclasses.dataclass(frozen=True)
class Value:
    """A graph value standing in for a KerasTensor during the walk."""

    name: str
    elem_type: int
    rank: Optional[int] = None


class ExportError(ValueError):
    """A layer, option or call the exporter cannot write (a ValueError)."""


class Context:
    """State of one export: the ModelBuilder, the decode cache plumbing, the layer path."""

    def __init__(self, builder: ModelBuilder, decode: bool, dynamic: bool = True,
                 batch_size: int = 1, cache_length: Optional[int] = None):
        self.b = builder
        self.dynamic, self.batch_size, self.cache_length = dynamic, batch_size, cache_length
        self.e = builder.e
        self.ft = builder.ft
        self.decode = decode
        self.path: List[str] = []
        self.cache_index: Optional[str] = None
        self.caches: List[dict] = []          # per DCMHA call: layer id, entry -> (past, present)
        self.single_layer = False

    def where(self) -> str:
        return "/".join(self.path)

    def weight(self, layer, name: str, array) -> str:
        """An initializer for ``array`` named after the layer path, in the compute dtype."""
        arr = np.asarray(keras.ops.convert_to_numpy(array))
        full = f"{self.where()}/{name}" if self.path else name
        if arr.dtype.kind == "f":
            return self.b.add_initializer(full, arr)
        return self.b.add_initializer(full, arr, dtype=arr.dtype)

    def const(self, value) -> str:
        return self.e.const(value, self.ft)

    def fail(self, what: str) -> "ExportError":
        return ExportError(f"{what} (at {self.where() or '<top>'})")


Converter = Callable[..., Any]
_CONVERTERS: Dict[type, Converter] = {}


def register_converter(cls: type):
    """Decorator: ``fn(ctx, layer, *args, **kwargs) -> Value | structure`` converts ``cls``.

    ``args``/``kwargs`` are the layer's call arguments with ``Value`` in place of tensors.
    """
    def deco(fn):
        _CONVERTERS[cls] = fn
        return fn
    return deco


def converter_for(op) -> Optional[Converter]:
    """The converter registered for ``op``'s class or its nearest base class, or None."""
    for cls in type(op).__mro__:
        if cls in _CONVERTERS:
            return _CONVERTERS[cls]
    return None


def onnx_type(dtype: str, ft: int) -> int:
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype.startswith("float") or dtype == "bfloat16":
        return ft
    table = {"bool": TensorProto.BOOL, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
             "int16": TensorProto.INT16, "int8": TensorProto.INT8, "uint8": TensorProto.UINT8}
    if dtype not in table:
        raise ExportError(f"Inputs of dtype {dtype} are not supported by the ONNX exporter.")
    return table[dtype]
