"""Run an exported graph in onnxruntime and compare it with the Keras layer or model."""

from __future__ import annotations

import json
import math
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import onnx

from dcmha.export.call_spec import NP_DTYPES
from dcmha.export.runtime import session


def read_export_metadata(model_or_path) -> dict:
    """The ``dcmha.export`` metadata that ``to_onnx`` writes (kind, inputs, outputs, caches, ...)."""
    model = model_or_path if isinstance(model_or_path, onnx.ModelProto) else onnx.load(
        str(model_or_path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    if "dcmha.export" not in props:
        raise ValueError(f"{model_or_path} was not written by dcmha.export.to_onnx "
                         "(no 'dcmha.export' metadata).")
    return json.loads(props["dcmha.export"])


def _as_feeds(inputs, names: Sequence[str]) -> Dict[str, np.ndarray]:
    if isinstance(inputs, Mapping):
        unknown = sorted(set(inputs) - set(names))
        missing = [n for n in names if n not in inputs]
        if unknown or missing:
            raise ValueError(f"`inputs` must have the keys {list(names)}. Missing: {missing}; "
                             f"unknown: {unknown}")
        return {n: np.asarray(inputs[n]) for n in names}
    if isinstance(inputs, (list, tuple)):
        if len(inputs) != len(names):
            raise ValueError(f"`inputs` must hold {len(names)} arrays ({list(names)}). "
                             f"Received: {len(inputs)}")
        return {n: np.asarray(a) for n, a in zip(names, inputs)}
    if len(names) != 1:
        raise ValueError(f"`inputs` must be a dict or list for the inputs {list(names)}.")
    return {names[0]: np.asarray(inputs)}


def _cast(a: np.ndarray, np_dtype) -> np.ndarray:
    return a.astype(np_dtype) if a.dtype.kind == "f" else a


def _keras_reference(obj, meta: dict, feeds: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """The Keras outputs, through predict_on_batch (compiled on jax / tensorflow: much faster
    than an eager first call, which compiles op by op)."""
    import keras

    if meta["kind"] == "layer":
        names = [n for n in ("query", "value", "key", "attention_mask") if n in feeds]
        sym = {n: keras.Input(feeds[n].shape[1:], dtype="bool" if n == "attention_mask" else
                              "float32", name=n) for n in names}
        q = sym["query"]
        v = sym.get("value", q)
        out = obj(q, v, sym.get("key", v), attention_mask=sym.get("attention_mask"),
                  use_causal_mask=meta["use_causal_mask"] or meta["decode"],
                  return_attention_scores=meta["return_attention_scores"])
        model, args = keras.Model([sym[n] for n in names], out), [feeds[n] for n in names]
    else:
        model, args = obj, [feeds[n] for n in meta["inputs"]]
    res = model.predict_on_batch(args[0] if len(args) == 1 else args)
    return [np.asarray(keras.ops.convert_to_numpy(o), np.float64) for o in keras.tree.flatten(res)]


def _run_forward(sess, feeds, np_dtype) -> List[np.ndarray]:
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: _cast(feeds[n], np_dtype) for n in names})


def _run_decode(sess, meta: dict, feeds, np_dtype, steps, cache_length) -> List[np.ndarray]:
    """Run the sequence in ``feeds`` through the decode graph step by step from empty caches."""
    seq = [n for n in (["query", "attention_mask"] if meta["kind"] == "layer" else meta["inputs"])
           if n in feeds]
    B, T = feeds[seq[0]].shape[:2]
    S_max = cache_length or T
    if S_max < T:
        raise ValueError(f"cache_length must be at least the sequence length {T}. "
                         f"Received: {S_max}")
    caches = {}
    for entry in meta["caches"]:
        for n, past in entry["past"].items():
            caches[past] = (np.zeros([B, S_max] + [int(d) for d in entry["shapes"][n][2:]], np_dtype),
                            entry["present"][n])
    seqs = {}
    for n in seq:
        a = feeds[n]
        if a.dtype == bool and a.ndim == 3:   # an attention mask (B, T, S): pad S to the cache
            padded = np.zeros((B, T, S_max), bool)
            padded[:, :, :a.shape[2]] = a
            a = padded
        seqs[n] = a
    out_names = [o.name for o in sess.get_outputs()]
    collected: Dict[str, list] = {}
    i = 0
    for n in steps:
        step = {k: _cast(a[:, i:i + n], np_dtype) for k, a in seqs.items()}
        step[meta["cache_index"]] = np.array(i, np.int64)
        step.update({past: c for past, (c, _) in caches.items()})
        res = dict(zip(out_names, sess.run(None, step)))
        caches = {past: (res[present], present) for past, (_, present) in caches.items()}
        for name in meta["outputs"]:
            collected.setdefault(name, []).append(res[name])
        i += n
    axis = {name: 2 if name == "attention_scores" else 1 for name in meta["outputs"]}
    return [np.concatenate(collected[name], axis=axis[name]) for name in meta["outputs"]]


def verify(path, obj, inputs, *, decode_steps: Optional[Sequence[int]] = None,
           cache_length: Optional[int] = None) -> dict:
    """Run ``path`` in onnxruntime on ``inputs`` and compare with the Keras ``obj``.

    inputs: for a layer export, the query array or a dict with "query" (and
    "value", "key", "attention_mask" as the graph has them); for a model, one
    array, a list in the model's input order, or a dict by input name.
    A decode graph is run over the whole sequence from empty caches (prefill
    ``decode_steps[0]`` tokens, then the rest; default: half, then one token
    per step) and compared with the Keras forward of the full sequence.

    Returns {"max_abs": float, "max_rel": float, "outputs": {name: {"max_abs", "max_rel"}}}
    with max_rel = max|error| / max|expected|.
    """
    meta = read_export_metadata(path)
    sess = session(path)
    np_dtype = NP_DTYPES[meta["dtype"]]
    if meta["kind"] == "layer":
        names = [n for n in ("query", "value", "key", "attention_mask")
                 if n in meta["inputs"] or (meta["decode"] and n == "query")]
    else:
        names = meta["inputs"]
    feeds = _as_feeds(inputs, names)
    want = _keras_reference(obj, meta, feeds)
    if meta["decode"]:
        T = feeds[names[0]].shape[1]
        steps = list(decode_steps) if decode_steps else (
            [math.ceil(T / 2)] + [1] * (T - math.ceil(T / 2)))
        if sum(steps) != T:
            raise ValueError(f"decode_steps must sum to the sequence length {T}. Received: {steps}")
        got = _run_decode(sess, meta, feeds, np_dtype, steps, cache_length)
    else:
        got = _run_forward(sess, feeds, np_dtype)[:len(meta["outputs"])]
    report: Dict[str, dict] = {}
    for name, g, w in zip(meta["outputs"], got, want):
        g = np.asarray(g, np.float64)
        if g.shape != w.shape:
            if name == "attention_scores" and meta["decode"]:
                continue   # cache longer than the sequence: scores are not comparable
            raise ValueError(f"Output {name!r}: onnxruntime shape {g.shape} != Keras shape {w.shape}")
        err = float(np.max(np.abs(g - w))) if g.size else 0.0
        if np.isnan(g).any():
            err = float("nan")
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        report[name] = {"max_abs": err, "max_rel": err / scale if scale else err}
    return {"max_abs": max(r["max_abs"] for r in report.values()),
            "max_rel": max(r["max_rel"] for r in report.values()), "outputs": report}
