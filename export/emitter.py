"""The node emitter that every part of the exporter writes through, and the renaming of a
value in a node list (``rename_value``)."""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class Emitter:
    """Appends nodes with fresh value names; constants are Constant nodes so the
    same code writes function bodies (which cannot hold initializers) and graphs."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.nodes: List[onnx.NodeProto] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs):
        outs = [self.fresh(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh("n_" + op_type),
                                           domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, value, dtype) -> str:
        arr = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
        out = self.fresh("c")
        self.nodes.append(helper.make_node("Constant", [], [out], name=self.fresh("n_Constant"),
                                           value=numpy_helper.from_array(arr, out)))
        return out

    def i64(self, *values) -> str:
        return self.const(np.array(values, np.int64), TensorProto.INT64)

    def cast(self, x: str, src: int, dst: int) -> str:
        return x if src == dst else self.op("Cast", x, to=dst)

    def reshape(self, x: str, *shape) -> str:
        """Reshape to ints; 0 copies the input's dim at the same index."""
        return self.op("Reshape", x, self.i64(*shape))

    def dims(self, x: str, start: int, end: int) -> str:
        """The 1-D int64 tensor Shape(x)[start:end]."""
        return self.op("Shape", x, start=start, end=end)

    def scalar_dim(self, x: str, axis: int) -> str:
        return self.op("Squeeze", self.dims(x, axis, axis + 1), self.i64(0))


def rename_value(nodes: Sequence[onnx.NodeProto], old: str, new: str) -> bool:
    """Rename the value ``old`` to ``new`` where ``nodes`` produce and read it (in
    subgraphs too). False, changing nothing, when no node of ``nodes`` produces it."""
    producer = next((n for n in nodes if old in n.output), None)
    if producer is None:
        return False
    producer.output[list(producer.output).index(old)] = new

    def visit(ns):
        for node in ns:
            for i, x in enumerate(node.input):
                if x == old:
                    node.input[i] = new
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g.node)
    visit(nodes)
    return True
