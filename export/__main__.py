"""python -m dcmha.export MODEL.keras OUT.onnx [--decode] [--fp16] [--opset N]

Loads a saved Keras model containing DCMHA layers (a functional model, or a
``DCFormerLM``, exported through its functional twin), writes it as ONNX (see
``dcmha.export.to_onnx``) to a temporary file beside OUT.onnx, prints the
graph's inputs and outputs, verifies the graph in onnxruntime against the Keras
model on random inputs (batch --batch, sequence length --length), prints the
max abs / rel errors, and only when every output is within --max-rel renames
the file onto OUT.onnx. A file replaced there keeps its mode; a symlink there
is written through to its target.

With no Keras backend configured, the first installed of jax, torch, tensorflow
is used (one line on stderr says which).

Exit code 0 on success; 1 when the export or its verification fails; 2 for a
usage error (bad arguments, a missing output directory, a model that cannot be
loaded). On exit codes 1 and 2 nothing is written.
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


#: Default ``--max-rel`` per graph dtype: the largest max|error| / max|expected| of any output
#: that passes. A correct export stays far below (float32 ~1e-6, float16 ~1e-3 on the
#: README's models); a wrong weight, op or layout is far above.
MAX_REL = {"float32": 1e-4, "float16": 2e-2}


class VerificationFailed(Exception):
    """onnxruntime's outputs differ from Keras's by more than ``--max-rel``."""


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _exportable(model):
    """A subclassed model with a functional twin (DCFormerLM) is exported and verified through
    the twin: it has the graph inputs that export and verification read."""
    if callable(getattr(model, "as_functional", None)):
        return model.as_functional()
    return model


def _check_report(report: dict, max_rel: float) -> None:
    bad = {name: r["max_rel"] for name, r in report["outputs"].items()
           if not r["max_rel"] <= max_rel}           # NaN fails too
    if bad:
        worst = ", ".join(f"{name!r} max rel error {err:.3e}" for name, err in bad.items())
        raise VerificationFailed(f"onnxruntime differs from Keras: {worst} (allowed "
                                 f"{max_rel:.1e}, --max-rel)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcmha.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .keras file")
    ap.add_argument("out", help="the .onnx file to write (a symlink is written through)")
    ap.add_argument("--decode", action="store_true", help="write a single cached decode step")
    ap.add_argument("--fp16", action="store_true", help="float16 graph (scores/softmax in float32)")
    ap.add_argument("--opset", type=int, default=None, help="ONNX opset (default 18)")
    ap.add_argument("--no-compose-nodes", action="store_true",
                    help="write the composes as plain ops instead of dcmha.Compose* nodes "
                         "(functions that onnxruntime runs as the compiled kernel when "
                         "dcmha.export.ort_ops is registered)")
    ap.add_argument("--batch", type=int, default=2, help="batch of the verification inputs")
    ap.add_argument("--length", type=int, default=8, help="sequence length of the verification inputs")
    ap.add_argument("--max-rel", type=float, default=None,
                    help="largest max rel error that passes verification (default "
                         f"{MAX_REL['float32']:g}, with --fp16 {MAX_REL['float16']:g})")
    args = ap.parse_args(argv)
    for name in ("batch", "length"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be a positive integer. Received: {getattr(args, name)}")
    dtype = "float16" if args.fp16 else "float32"
    max_rel = MAX_REL[dtype] if args.max_rel is None else args.max_rel
    if not max_rel >= 0:
        ap.error(f"--max-rel must be a non-negative number. Received: {args.max_rel}")

    from dcmha.export.core import FUNCTION_NAME, atomic_output, output_target

    try:        # before anything is loaded or built
        output_target(args.out)
    except ValueError as err:
        print(f"error: cannot write {args.out}: {err}", file=sys.stderr)
        return 2

    from dcmha._keras_backend import ensure_keras_backend

    ensure_keras_backend()        # before Keras is imported
    import keras                  # (importing it registers dcmha's classes: see dcmha/__init__)
    import onnx

    from dcmha.export import to_onnx, verify

    try:
        model = _exportable(keras.saving.load_model(args.model))
    except Exception as err:  # noqa: BLE001 - report any load failure plainly
        print(f"error: cannot load {args.model}: {err}", file=sys.stderr)
        return 2
    try:
        # Exported to a temporary file beside the target, verified there, renamed
        # onto the target only when both pass: on any failure nothing is written.
        with atomic_output(args.out) as tmp:
            proto = to_onnx(model, tmp, opset=args.opset, decode=args.decode, dtype=dtype,
                            compose_nodes=not args.no_compose_nodes)
            n_dcmha = sum(1 for f in proto.functions if f.name.startswith(FUNCTION_NAME))
            n_compose = len(proto.functions) - n_dcmha
            print(f"graph (opset {proto.opset_import[0].version}, "
                  f"{n_dcmha} DCMHA function(s), {n_compose} Compose function(s))")
            print("inputs:")
            for v in proto.graph.input:
                print(_describe(v))
            print("outputs:")
            for v in proto.graph.output:
                print(_describe(v))
            report = verify(tmp, model, random_inputs(model, args.batch, args.length))
            print(f"verification (onnxruntime vs Keras {keras.backend.backend()}, batch "
                  f"{args.batch}, length {args.length}):")
            for name, r in report["outputs"].items():
                print(f"  {name:<28} max abs error {r['max_abs']:.3e}  "
                      f"max rel error {r['max_rel']:.3e}")
            _check_report(report, max_rel)
    except VerificationFailed as err:
        print(f"error: verification failed, nothing written: {err}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError, RuntimeError, onnx.checker.ValidationError) as err:
        print(f"error: export failed, nothing written: {_first_line(err)}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
