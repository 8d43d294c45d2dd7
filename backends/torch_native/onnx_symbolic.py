"""``aten::rms_norm`` for PyTorch's TorchScript ONNX exporter.

Keras's RMSNormalization calls ``torch.nn.functional.rms_norm`` on torch, and Keras's
ONNX export of a model with dynamic sizes goes through the TorchScript exporter (opsets
<= 20), which has no translation for it.
"""

from __future__ import annotations


def register_rms_norm():
    """Teach the exporter ``aten::rms_norm``: x / sqrt(mean(x^2 over the normalized axes)
    + eps) * weight from ONNX primitives; registered at opset 1, it serves every opset
    >= 9. Registering again replaces it (idempotent)."""
    import torch
    from torch.onnx import symbolic_helper

    @symbolic_helper.parse_args("v", "v", "v", "f")
    def rms_norm(g, x, normalized_shape, weight, eps):
        node = normalized_shape.node()
        if node.kind() == "prim::ListConstruct":   # sizes read from the traced input
            rank = node.inputsSize()
        else:                                      # a constant list
            rank = len(symbolic_helper._get_const(normalized_shape, "is", "normalized_shape"))
        axes = list(range(-rank, 0))
        square = g.op("Mul", x, x)
        if g.opset >= 18:   # ReduceMean takes its axes as an input from opset 18 on
            mean = g.op("ReduceMean", square,
                        g.op("Constant", value_t=torch.tensor(axes, dtype=torch.int64)),
                        keepdims_i=1)
        else:
            mean = g.op("ReduceMean", square, axes_i=axes, keepdims_i=1)
        eps = g.op("Constant", value_t=torch.tensor(eps, dtype=torch.float32))
        y = g.op("Div", x, g.op("Sqrt", g.op("Add", mean, eps)))
        return y if weight.node().mustBeNone() else g.op("Mul", y, weight)

    torch.onnx.register_custom_op_symbolic("aten::rms_norm", rms_norm, 1)
