"""python -m dcmha.export MODEL.keras OUT.onnx [--decode] [--fp16] [--opset N]

Loads a saved Keras model containing DCMHA layers, writes it as ONNX (see
``dcmha.export.to_onnx``), prints the graph's inputs and outputs, and verifies
the graph in onnxruntime against the Keras model on random inputs (batch
--batch, sequence length --length), printing the max abs / rel errors.
Exit code 0 on success, 1 when the export fails (nothing is written), 2 for a
usage error.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def _describe(value_info) -> str:
    import onnx

    t = value_info.type.tensor_type
    dims = [d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?")
            for d in t.shape.dim] if t.HasField("shape") else ["?"]
    return f"  {value_info.name:<28} {onnx.TensorProto.DataType.Name(t.elem_type).lower():<8} " \
           f"({', '.join(dims)})"


def random_inputs(model, batch: int, length: int, seed: int = 0):
    """Random inputs for a Keras model: normal floats, token ids below the smallest
    Embedding vocabulary, causal bool masks for rank-3 bool inputs."""
    import keras

    rng = np.random.default_rng(seed)
    vocab = [layer.input_dim for layer in model._flatten_layers()
             if isinstance(layer, keras.layers.Embedding)]
    out = []
    for t in model.inputs:
        shape = [batch if i == 0 and s is None else (length if s is None else s)
                 for i, s in enumerate(t.shape)]
        dtype = keras.backend.standardize_dtype(t.dtype)
        if dtype == "bool":
            a = rng.random(shape) > 0.2
            if a.ndim == 3:
                a |= np.eye(shape[1], shape[2], dtype=bool)[None]
        elif dtype.startswith("int") or dtype.startswith("uint"):
            a = rng.integers(0, min(vocab) if vocab else 2, size=shape).astype(dtype)
        else:
            a = rng.normal(size=shape).astype("float32")
        out.append(a)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcmha.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .keras file")
    ap.add_argument("out", help="the .onnx file to write")
    ap.add_argument("--decode", action="store_true", help="write a single cached decode step")
    ap.add_argument("--fp16", action="store_true", help="float16 graph (scores/softmax in float32)")
    ap.add_argument("--opset", type=int, default=None, help="ONNX opset (default 18)")
    ap.add_argument("--batch", type=int, default=2, help="batch of the verification inputs")
    ap.add_argument("--length", type=int, default=8, help="sequence length of the verification inputs")
    args = ap.parse_args(argv)

    import keras
    import onnx

    import dcmha.layers  # noqa: F401  (registers DCMHA for deserialisation)
    from dcmha.export import to_onnx, verify

    try:
        import dcmha.models  # noqa: F401  (registers the DCFormer layers, if present)
    except ImportError:
        pass

    try:
        model = keras.saving.load_model(args.model)
    except Exception as err:  # noqa: BLE001 - report any load failure plainly
        print(f"error: cannot load {args.model}: {err}", file=sys.stderr)
        return 2
    try:
        proto = to_onnx(model, args.out, opset=args.opset, decode=args.decode,
                        dtype="float16" if args.fp16 else "float32")
    except (ValueError, TypeError, onnx.checker.ValidationError) as err:
        print(f"error: export failed, nothing written: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} (opset {proto.opset_import[0].version}, "
          f"{len(proto.functions)} DCMHA function(s))")
    print("inputs:")
    for v in proto.graph.input:
        print(_describe(v))
    print("outputs:")
    for v in proto.graph.output:
        print(_describe(v))
    report = verify(args.out, model, random_inputs(model, args.batch, args.length))
    print(f"verification (onnxruntime vs Keras {keras.backend.backend()}, batch {args.batch}, "
          f"length {args.length}):")
    for name, r in report["outputs"].items():
        print(f"  {name:<28} max abs error {r['max_abs']:.3e}  max rel error {r['max_rel']:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
