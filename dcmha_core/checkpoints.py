"""Load official DCFormer PyTorch checkpoints into `dcmha.models.DCFormerLM`.

The official PyTorch model (Caiyun-AI/DCFormer, gpt-fast style) stores, per
layer i (N heads, N_kv kv heads, head size d, width D, I = intermediate size):

    layers.i.attention.wqkv.weight       ((N + 2 N_kv) d, D)  torch Linear, rows q | k | v
      (older files: wq.weight (N d, D), wk.weight / wv.weight (N_kv d, D))
    layers.i.attention.wo.weight         (D, N d)
    layers.i.attention.dyn_w_proj.dw1    (D, G, 4, K)          as the spec's dw1
    layers.i.attention.dyn_w_proj.qkw    (G, 4, K, 2R, M)      as the spec's qkw
    layers.i.attention.dyn_w_proj.dd     (D, G, 4M)            as the spec's dd
    layers.i.attention.q_norm.scale, k_norm.scale  (d,)        with use_qk_norm
    layers.i.attention_norm.weight, layers.i.ffn_norm.weight   (D,)
    layers.i.feed_forward.w1.weight / w3.weight  (I, D);  w2.weight (D, I)
    tok_embeddings.weight (V, D); norm.weight (D,); output.weight (V, D) unless tied

A torch Linear computes y = x W^T, so every Linear weight is transposed into a
Keras kernel; wqkv is split by rows and reshaped head-major ((N, d) per row
block). Derived copies and buffers are ignored: dyn_w_proj.dw_m, qkw_m,
pre_proj.w / post_proj.w (checked to be the identity: static composition is
not supported), kv_cache.*, freqs_cis, causal_mask.

Config keys follow the official DCFormerConfig; missing keys take its
defaults and unrelated keys are ignored. The composition sizes G, K, R are
read from the dw1/qkw shapes. The official PyTorch DCMHA uses exact (erf) GELU,
so the converted model uses ``gelu_approximate=False`` unless overridden.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import re
import zipfile
from typing import Mapping

import numpy as np

__all__ = ["from_official_state_dict", "official_config_to_kwargs", "to_official_state_dict",
           "official_model_arguments", "read_torch_bin", "read_safetensors",
           "load_official_state_dict", "read_official_config", "from_official_directory",
           "resolve_checkpoint_dir", "write_official_directory"]

#: Defaults of the official DCFormerConfig for the keys that matter here.
OFFICIAL_DEFAULTS = dict(
    vocab_size=32000, n_layer=32, n_head=32, dim=2560, intermediate_size=None,
    n_local_heads=-1, rope_base=500000.0, norm_eps=1e-5, use_qk_norm=False, window_size=256,
    window_type=None, use_dcmha=True, query_wise=False, mgate=False, tie_word_embeddings=False)

_IGNORED = (
    re.compile(r"^layers\.\d+\.attention\.dyn_w_proj\.(dw_m|qkw_m)$"),
    re.compile(r"(^|\.)kv_cache\.[^.]+$"),
    re.compile(r"(^|\.)(freqs_cis|causal_mask)$"),
)
_STATIC = re.compile(r"^layers\.\d+\.attention\.dyn_w_proj\.(pre_proj|post_proj)\.w$")


def _config_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if not hasattr(config, "__dict__"):
        raise TypeError("`config` must be a dict or an object with attributes (e.g. a "
                        f"transformers config). Received: {type(config).__name__}")
    return dict(vars(config))


def _to_numpy(name, value) -> np.ndarray:
    # Duck-typed torch support (no torch import): detach, move to CPU, widen
    # bfloat16 (which NumPy lacks) before .numpy().
    if hasattr(value, "detach"):
        value = value.detach()
        if hasattr(value, "cpu"):
            value = value.cpu()
        if "bfloat16" in str(getattr(value, "dtype", "")):
            value = value.float()
        value = value.numpy()
    try:
        out = np.asarray(value)
    except Exception as e:  # pragma: no cover - exotic inputs
        raise TypeError(f"state_dict[{name!r}] is not an array or tensor: {type(value)}") from e
    if not np.issubdtype(out.dtype, np.number) or np.issubdtype(out.dtype, np.complexfloating):
        raise TypeError(f"state_dict[{name!r}] must be a real-valued array or tensor. "
                        f"Received: dtype {out.dtype}")
    return out


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


#: The config keys read, each with its check and what the check requires. Values are
#: checked, never coerced: int(4.7) would truncate a float silently, and bool('false') is True.
_CONFIG_CHECKS = (
    (("vocab_size", "n_layer", "n_head", "dim"), lambda v: _is_int(v) and v > 0,
     "a positive integer"),
    (("intermediate_size", "window_size"), lambda v: v is None or (_is_int(v) and v > 0),
     "None or a positive integer"),
    (("n_local_heads",), lambda v: v is None or (_is_int(v) and (v == -1 or v > 0)),
     "None, -1 or a positive integer"),
    (("rope_base", "norm_eps"),
     lambda v: (_is_int(v) or isinstance(v, (float, np.floating))) and 0 < v < float("inf"),
     "a positive number"),
    (("use_qk_norm", "use_dcmha", "query_wise", "mgate", "tie_word_embeddings"),
     lambda v: isinstance(v, (bool, np.bool_)), "a bool (True or False; strings and numbers are "
     "not accepted)"),
)


def _check_config_types(cfg: dict) -> None:
    for keys, ok, expected in _CONFIG_CHECKS:
        for key in keys:
            if not ok(cfg[key]):
                raise ValueError(f"Config key {key!r} must be {expected}. Received: "
                                 f"{cfg[key]!r}")


def official_config_to_kwargs(config) -> dict:
    """`DCFormerLM` keyword arguments for an official DCFormer config (dict or object).

    Composition sizes (num_groups, rank, dynamic_hidden_dim) are not config keys
    in the official code; `from_official_state_dict` reads them from the weights.
    """
    cfg = {**OFFICIAL_DEFAULTS, **_config_dict(config)}
    _check_config_types(cfg)
    if cfg["mgate"]:
        raise ValueError("Unsupported DCFormer config: mgate=True (the gated-mixture FFN variant) "
                         "is not implemented by dcmha.models.")
    if cfg["query_wise"]:
        raise ValueError("Unsupported DCFormer config: query_wise=True (the official decode-time "
                         "shortcut that drops key-wise weights) is not implemented; load with "
                         "query_wise=False for the exact model.")
    n_head, dim = int(cfg["n_head"]), int(cfg["dim"])
    n_kv = cfg["n_local_heads"]
    n_kv = n_head if n_kv in (None, -1) else int(n_kv)
    if dim % n_head:
        raise ValueError(f"Config 'dim' ({dim}) must be divisible by 'n_head' ({n_head}).")
    if n_kv <= 0 or n_head % n_kv:
        raise ValueError(f"Config 'n_local_heads' ({cfg['n_local_heads']}) must be -1 or divide "
                         f"'n_head' ({n_head}).")
    inter = cfg["intermediate_size"]
    if inter is None:
        from dcmha.models import official_intermediate_size
        inter = official_intermediate_size(dim, 256)
    window_type = cfg["window_type"] or "LG"
    if not isinstance(window_type, str) or set(window_type) - {"L", "G"}:
        raise ValueError("Unsupported DCFormer config: window_type must be None or a string of "
                         f"'L' and 'G' (e.g. 'LGLL'). Received: {cfg['window_type']!r}")
    window = cfg["window_size"]
    return dict(
        vocab_size=int(cfg["vocab_size"]), num_layers=int(cfg["n_layer"]), hidden_dim=dim,
        num_heads=n_head, num_key_value_heads=None if n_kv == n_head else n_kv,
        # The official config recomputes head_dim = dim // n_head after init, so a
        # stored head_dim never differs from it in a real checkpoint.
        head_dim=dim // n_head, intermediate_dim=int(inter),
        sliding_window=None if window is None else int(window), window_pattern=window_type,
        qk_norm=bool(cfg["use_qk_norm"]), rope_max_wavelength=float(cfg["rope_base"]),
        norm_eps=float(cfg["norm_eps"]), tie_embeddings=bool(cfg["tie_word_embeddings"]),
        attention="dcmha" if cfg["use_dcmha"] else "mha")


def _layer_shapes(i, kw, G, K, R, fused) -> dict:
    D, N, d = kw["hidden_dim"], kw["num_heads"], kw["head_dim"]
    N_kv = kw["num_key_value_heads"] or N
    M, I = N // G, kw["intermediate_dim"]
    p = f"layers.{i}."
    s = {p + "attention_norm.weight": (D,), p + "ffn_norm.weight": (D,),
         p + "attention.wo.weight": (D, N * d),
         p + "feed_forward.w1.weight": (I, D), p + "feed_forward.w3.weight": (I, D),
         p + "feed_forward.w2.weight": (D, I)}
    if fused:
        s[p + "attention.wqkv.weight"] = ((N + 2 * N_kv) * d, D)
    else:
        s.update({p + "attention.wq.weight": (N * d, D), p + "attention.wk.weight": (N_kv * d, D),
                  p + "attention.wv.weight": (N_kv * d, D)})
    if kw["attention"] == "dcmha":
        s.update({p + "attention.dyn_w_proj.dw1": (D, G, 4, K),
                  p + "attention.dyn_w_proj.qkw": (G, 4, K, 2 * R, M),
                  p + "attention.dyn_w_proj.dd": (D, G, 4 * M)})
    if kw["qk_norm"]:
        s.update({p + "attention.q_norm.scale": (d,), p + "attention.k_norm.scale": (d,)})
    return s


def _composition_sizes(sd, kw):
    """(G, K, R) from layer 0's dw1 / qkw, validated against the head count."""
    if kw["attention"] != "dcmha":
        return 1, None, 2
    N = kw["num_heads"]
    name = "layers.0.attention.dyn_w_proj.dw1"
    if name not in sd:
        raise ValueError(f"Missing state_dict entry {name!r} (expected shape (D, G, 4, K)).")
    dw1 = sd[name]
    if dw1.ndim != 4 or dw1.shape[2] != 4 or dw1.shape[1] <= 0 or N % dw1.shape[1]:
        raise ValueError(f"state_dict[{name!r}] has shape {dw1.shape}; expected (D, G, 4, K) with "
                         f"G dividing n_head={N}.")
    G, K = int(dw1.shape[1]), int(dw1.shape[3])
    name = "layers.0.attention.dyn_w_proj.qkw"
    if name not in sd:
        raise ValueError(f"Missing state_dict entry {name!r} (expected shape (G, 4, K, 2R, M)).")
    qkw = sd[name]
    if qkw.ndim != 5 or qkw.shape[3] % 2 or qkw.shape[3] == 0:
        raise ValueError(f"state_dict[{name!r}] has shape {qkw.shape}; expected (G, 4, K, 2R, M)"
                         f" = ({G}, 4, {K}, 2R, {N // G}).")
    return G, K, int(qkw.shape[3]) // 2


def from_official_state_dict(state_dict: Mapping, config, *, dtype=None, **overrides):
    """Build a `DCFormerLM` holding the weights of an official PyTorch state_dict.

    Args:
        state_dict: mapping name -> NumPy array or torch tensor (official layout,
            see the module docstring).
        config: the official config, as a dict (e.g. config.json) or an object
            with attributes (e.g. a transformers config).
        dtype: Keras dtype policy of the model (default: Keras's floatx).
        **overrides: further `DCFormerLM` arguments, e.g. ``gelu_approximate=True``
            or ``query_chunk_size=128``.

    Returns:
        A built `DCFormerLM` whose logits equal the official model's.

    Raises:
        ValueError naming the key for a missing, unexpected or mis-shaped
        entry, and for unsupported config options (mgate, query_wise).
    """
    from dcmha.models import DCFormerLM

    sd, kw, args = official_model_arguments(state_dict, config, dtype=dtype, **overrides)
    model = DCFormerLM(**args)
    model.build((None, None))
    _assign_all(model, sd, kw)
    return model


def official_model_arguments(state_dict: Mapping, config, *, dtype=None, **overrides):
    """The checked state dict (NumPy), the converted config and the `DCFormerLM`
    arguments of an official checkpoint: the part of `from_official_state_dict`
    that any model with DCFormerLM's layers (e.g. `dcmha.hub.DCFormerBackbone`) reuses."""
    if not isinstance(state_dict, Mapping):
        raise TypeError("`state_dict` must be a mapping {name: array or tensor}. "
                        f"Received: {type(state_dict).__name__}")
    kw = official_config_to_kwargs(config)
    sd = {str(k): _to_numpy(k, v) for k, v in state_dict.items()}
    G, K, R = _composition_sizes(sd, kw)
    expected = {"tok_embeddings.weight": (kw["vocab_size"], kw["hidden_dim"]),
                "norm.weight": (kw["hidden_dim"],)}
    if not kw["tie_embeddings"]:
        expected["output.weight"] = (kw["vocab_size"], kw["hidden_dim"])
    for i in range(kw["num_layers"]):
        expected.update(_layer_shapes(i, kw, G, K, R,
                                      fused=f"layers.{i}.attention.wqkv.weight" in sd))
    unexpected = []
    for name in sd:
        if name in expected or any(p.search(name) for p in _IGNORED):
            continue
        if _STATIC.match(name):
            w = sd[name]
            if w.ndim < 2 or w.shape[-1] != w.shape[-2] or not np.allclose(
                    w, np.eye(w.shape[-1]), atol=1e-6):
                raise ValueError(f"state_dict[{name!r}] is not the identity: static composition "
                                 "weights are not supported by from_official_state_dict.")
            continue
        if name == "output.weight" and kw["tie_embeddings"]:
            if sd[name].shape != sd.get("tok_embeddings.weight", np.empty(0)).shape or not \
                    np.array_equal(sd[name], sd["tok_embeddings.weight"]):
                raise ValueError("state_dict['output.weight'] differs from 'tok_embeddings.weight' "
                                 "but the config has tie_word_embeddings=True.")
            continue
        unexpected.append(name)
    if unexpected:
        raise ValueError(f"Unexpected state_dict entries (not part of the official DCFormer "
                         f"layout for this config): {sorted(unexpected)[:10]}"
                         + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
    missing = [n for n in expected if n not in sd]
    if missing:
        raise ValueError(f"Missing state_dict entry {missing[0]!r} (expected shape "
                         f"{expected[missing[0]]})"
                         + (f" and {len(missing) - 1} more: {missing[1:6]}" if len(missing) > 1
                            else "") + ".")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != tuple(shape):
            raise ValueError(f"state_dict[{name!r}] has shape {tuple(sd[name].shape)}; expected "
                             f"{tuple(shape)} for this config.")

    args = dict(kw, gelu_approximate=False)
    if kw["attention"] == "dcmha":
        args.update(num_groups=G, rank=R,
                    dynamic_hidden_dim=None if K == 2 * R * (kw["num_heads"] // G) else K)
    args.update(overrides)
    if dtype is not None:
        args["dtype"] = dtype
    return sd, kw, args


def _assign(variable, value):
    variable.assign(np.asarray(value, dtype=variable.dtype))


def _assign_all(model, sd, kw):
    D, N, d = kw["hidden_dim"], kw["num_heads"], kw["head_dim"]
    N_kv = kw["num_key_value_heads"] or N
    _assign(model.tok_embeddings.embeddings, sd["tok_embeddings.weight"])
    _assign(model.norm.scale, sd["norm.weight"])
    if model.output_projection is not None:
        _assign(model.output_projection.kernel, sd["output.weight"].T)
    for i, block in enumerate(model.blocks):
        p = f"layers.{i}."
        a = p + "attention."
        if a + "wqkv.weight" in sd:
            wq, wk, wv = np.split(sd[a + "wqkv.weight"], [N * d, (N + N_kv) * d], axis=0)
        else:
            wq, wk, wv = sd[a + "wq.weight"], sd[a + "wk.weight"], sd[a + "wv.weight"]
        spec = {"query_kernel": wq.T.reshape(D, N, d), "key_kernel": wk.T.reshape(D, N_kv, d),
                "value_kernel": wv.T.reshape(D, N_kv, d),
                "output_kernel": sd[a + "wo.weight"].T.reshape(N, d, D)}
        if kw["attention"] == "dcmha":
            for n in ("dw1", "qkw", "dd"):
                spec[n] = sd[a + "dyn_w_proj." + n]
        if kw["qk_norm"]:
            spec["query_norm_scale"] = sd[a + "q_norm.scale"]
            spec["key_norm_scale"] = sd[a + "k_norm.scale"]
        block.attention.load_spec_weights(spec)
        _assign(block.attention_norm.scale, sd[p + "attention_norm.weight"])
        _assign(block.ffn_norm.scale, sd[p + "ffn_norm.weight"])
        for n in ("w1", "w3", "w2"):
            _assign(getattr(block.feed_forward, n).kernel, sd[p + f"feed_forward.{n}.weight"].T)


def to_official_state_dict(model, fused_qkv: bool = True) -> dict:
    """The inverse of `from_official_state_dict`: NumPy arrays in the official layout.

    Only for models whose attention layers use the official composition layout
    (all slots on, no static weights, no biases).
    """
    import keras

    def np_(v):
        return np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float32)

    sd = {"tok_embeddings.weight": np_(model.tok_embeddings.embeddings),
          "norm.weight": np_(model.norm.scale)}
    if model.output_projection is not None:
        sd["output.weight"] = np_(model.output_projection.kernel).T
    for i, block in enumerate(model.blocks):
        p, a = f"layers.{i}.", f"layers.{i}.attention."
        w = {n: np.asarray(v, np.float32) for n, v in block.attention.spec_weights().items()}
        unsupported = sorted(set(w) - {"query_kernel", "key_kernel", "value_kernel",
                                       "output_kernel", "dw1", "qkw", "dd", "query_norm_scale",
                                       "key_norm_scale"})
        if unsupported or (("dw1" in w) and w["dw1"].shape[2] != 4):
            raise ValueError(f"Layer {i} has no official equivalent (parameters {unsupported}, "
                             "or not all four composition slots).")
        D = w["query_kernel"].shape[0]
        q, k, v = (w[n].reshape(D, -1).T for n in ("query_kernel", "key_kernel", "value_kernel"))
        if fused_qkv:
            sd[a + "wqkv.weight"] = np.concatenate([q, k, v], axis=0)
        else:
            sd.update({a + "wq.weight": q, a + "wk.weight": k, a + "wv.weight": v})
        sd[a + "wo.weight"] = w["output_kernel"].reshape(-1, D).T
        for n in ("dw1", "qkw", "dd"):
            if n in w:
                sd[a + "dyn_w_proj." + n] = w[n]
        if "query_norm_scale" in w:
            sd[a + "q_norm.scale"] = w["query_norm_scale"]
            sd[a + "k_norm.scale"] = w["key_norm_scale"]
        sd[p + "attention_norm.weight"] = np_(block.attention_norm.scale)
        sd[p + "ffn_norm.weight"] = np_(block.ffn_norm.scale)
        for n in ("w1", "w3", "w2"):
            sd[p + f"feed_forward.{n}.weight"] = np_(getattr(block.feed_forward, n).kernel).T
    return sd


# ---------------------------------------------------------------------------
# Checkpoint directories in the release layout
# ---------------------------------------------------------------------------
#
#   config.json                                  the official config (a Hugging Face config)
#   pytorch_model.bin                            one torch.save'd state dict, or shards:
#   pytorch_model-00001-of-0000N.bin + pytorch_model.bin.index.json
#   model.safetensors                            or shards:
#   model-00001-of-0000N.safetensors + model.safetensors.index.json
#   tokenizer.json                               (read by dcmha.hub.DCFormerTokenizer)
#
# An index file is JSON {"metadata": {...}, "weight_map": {name: shard file name}}.

#: torch storage classes -> NumPy dtype of their elements ("bfloat16": uint16 words,
#: widened to float32 below, since NumPy has no bfloat16).
_TORCH_STORAGES = {"FloatStorage": "float32", "DoubleStorage": "float64",
                   "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
                   "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
                   "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U8": "uint8", "BOOL": "bool"}


def _bfloat16_to_float32(words: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32: bfloat16 is the top half of a float32."""
    return (words.astype(np.uint32) << 16).view(np.float32)


class _Storage:
    """One torch storage of a .bin archive, read on first use."""

    def __init__(self, archive, record, dtype, numel):
        self.archive, self.record, self.dtype, self.numel = archive, record, dtype, numel
        self._data = None

    def data(self) -> np.ndarray:
        if self._data is None:
            raw = self.archive.read(self.record)
            words = np.frombuffer(raw, dtype="uint16" if self.dtype == "bfloat16"
                                  else self.dtype)
            self._data = words
        return self._data


def _rebuild_tensor(storage, offset, size, stride, *_ignored):
    """torch._utils._rebuild_tensor_v2 for NumPy: a strided view of the storage, copied."""
    data = storage.data()
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if size and any(s == 0 for s in size):
        out = np.zeros(size, data.dtype)
    else:
        last = int(offset) + sum((n - 1) * s for n, s in zip(size, stride))
        if int(offset) < 0 or last >= data.size or any(s < 0 for s in stride):
            raise ValueError(f"Tensor view (offset {offset}, size {size}, stride {stride}) "
                             f"lies outside its storage of {data.size} elements.")
        out = np.lib.stride_tricks.as_strided(
            data[int(offset):], shape=size,
            strides=tuple(s * data.itemsize for s in stride)).copy()
    if storage.dtype == "bfloat16":
        out = _bfloat16_to_float32(out)
    return out


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *_ignored):
    return data


class _WeightsOnlyUnpickler(pickle.Unpickler):
    """Unpickles a torch.save'd state dict without torch and without running any code:
    only OrderedDict, the two tensor rebuild functions and the storage classes resolve;
    every other global is refused."""

    _ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
                ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}

    def __init__(self, file, archive, prefix, filename):
        super().__init__(file)
        self.archive, self.prefix, self.filename = archive, prefix, filename
        self.storages = {}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        if module == "torch" and name in _TORCH_STORAGES:
            return ("storage class", _TORCH_STORAGES[name])
        raise ValueError(f"{self.filename}: refusing to unpickle the global '{module}.{name}' "
                         "(a weights-only checkpoint holds tensors, not objects).")

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not (isinstance(pid[1], tuple) and pid[1][:1] == ("storage class",))):
            raise ValueError(f"{self.filename}: unsupported persistent id {pid!r:.200}")
        _, (_, dtype), key, _location, numel = pid
        if key not in self.storages:
            self.storages[key] = _Storage(self.archive, f"{self.prefix}data/{key}", dtype,
                                          int(numel))
        return self.storages[key]


def read_torch_bin(path) -> dict:
    """The state dict of a `torch.save` zip archive (pytorch_model*.bin) as NumPy arrays.

    Weights only and without torch: the pickle may name nothing but
    ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2`` /
    ``_rebuild_parameter`` and torch's storage classes; anything else raises a
    ValueError naming the file and the global. Views (e.g. the official
    ``qkw_m``, a view of ``qkw``) are read through their offset and strides.
    bfloat16 storages come back as float32 (exact).
    """
    path = os.fspath(path)
    name = os.path.basename(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{name}: not a torch zip archive (torch.save's legacy non-zip format "
                         "is not supported; re-save it with a current torch).")
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("data.pkl")
                   and n.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(f"{name}: expected one '<archive>/data.pkl' record, found "
                             f"{pickles}.")
        prefix = pickles[0][:-len("data.pkl")]
        order = archive.read(prefix + "byteorder").decode().strip() \
            if prefix + "byteorder" in archive.namelist() else "little"
        if order != "little":
            raise ValueError(f"{name}: byte order {order!r}; only little-endian is supported.")
        with archive.open(pickles[0]) as f:
            result = _WeightsOnlyUnpickler(f, archive, prefix, name).load()
    if not isinstance(result, Mapping):
        raise ValueError(f"{name}: holds a {type(result).__name__}, not a state dict.")
    return {str(k): v for k, v in result.items()}


def read_safetensors(path) -> dict:
    """A .safetensors file as NumPy arrays (safetensors' NumPy API; bfloat16, which
    NumPy lacks, is read as its uint16 words and widened to float32, exact)."""
    from safetensors import safe_open

    path = os.fspath(path)
    out, bf16 = {}, []
    with safe_open(path, framework="np") as f:
        for key in f.keys():
            if f.get_slice(key).get_dtype() == "BF16":
                bf16.append(key)
            else:
                out[key] = f.get_tensor(key)
    if bf16:
        # The format: an 8-byte little-endian header size, a JSON header
        # {name: {dtype, shape, data_offsets}}, then the data.
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            for key in bf16:
                begin, end = header[key]["data_offsets"]
                fh.seek(8 + n + begin)
                words = np.frombuffer(fh.read(end - begin), dtype="<u2")
                out[key] = _bfloat16_to_float32(words).reshape(header[key]["shape"])
    return out


_WEIGHT_FORMATS = (  # (index file, single file, reader), safetensors first
    ("model.safetensors.index.json", "model.safetensors", read_safetensors),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", read_torch_bin),
)


def load_official_state_dict(directory) -> dict:
    """The state dict of a checkpoint directory in the release layout (NumPy arrays).

    Reads ``model.safetensors`` (or its shards with ``model.safetensors.index.json``)
    when present, else ``pytorch_model.bin`` (or its shards with
    ``pytorch_model.bin.index.json``); see `read_torch_bin` / `read_safetensors`.
    """
    directory = os.fspath(directory)
    for index, single, reader in _WEIGHT_FORMATS:
        if os.path.isfile(os.path.join(directory, index)):
            with open(os.path.join(directory, index)) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: no 'weight_map' {{name: file}} in the index file.")
            sd = {}
            for shard in sorted(set(weight_map.values())):
                shard_path = os.path.join(directory, shard)
                if os.path.basename(shard) != shard or not os.path.isfile(shard_path):
                    raise ValueError(f"{index} names the shard {shard!r}, which is not a file "
                                     f"in {directory}.")
                sd.update(reader(shard_path))
            missing = sorted(set(weight_map) - set(sd))
            if missing:
                raise ValueError(f"{index} maps {missing[:5]} to shards that do not hold them.")
            return sd
        if os.path.isfile(os.path.join(directory, single)):
            return reader(os.path.join(directory, single))
    raise ValueError(f"{directory} holds no weights: expected model.safetensors, "
                     "pytorch_model.bin, or one of their .index.json files with shards. "
                     f"Found: {sorted(os.listdir(directory))[:10]}")


def resolve_checkpoint_dir(path_or_handle) -> str:
    """A local directory for a directory path or an ``hf://owner/name`` handle
    (downloaded with huggingface_hub, or taken from its cache)."""
    handle = os.fspath(path_or_handle)
    if handle.startswith("hf://"):
        repo = handle[len("hf://"):].strip("/")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise ValueError("A Hugging Face handle is 'hf://owner/name'. Received: "
                             f"{handle!r}")
        try:
            import huggingface_hub
        except ImportError:
            raise ImportError(f"Loading {handle} needs huggingface_hub: "
                              "pip install 'dcmha[hub]'.") from None
        try:
            return huggingface_hub.snapshot_download(
                repo, allow_patterns=["*.json", "*.bin", "*.safetensors", "*.model"])
        except Exception as err:  # noqa: BLE001 - one clear line instead of a network trace
            reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise OSError(f"Could not download {handle} from the Hugging Face Hub "
                          f"({type(err).__name__}: {reason}). Check the network and the "
                          "repository name, or pass a local directory.") from None
    if not os.path.isdir(handle):
        raise ValueError("`path_or_handle` must be a checkpoint directory (config.json plus "
                         "weights) or 'hf://owner/name'. Received: "
                         f"path_or_handle={handle!r}")
    return handle


def read_official_config(directory) -> dict:
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory} has no config.json (the official DCFormer config).")
    with open(path) as f:
        return json.load(f)


def from_official_directory(path_or_handle, *, dtype=None, **overrides):
    """`from_official_state_dict` on a checkpoint directory (or ``hf://owner/name``):
    config.json plus the weights read by `load_official_state_dict`."""
    directory = resolve_checkpoint_dir(path_or_handle)
    config = read_official_config(directory)
    return from_official_state_dict(load_official_state_dict(directory), config, dtype=dtype,
                                    **overrides)


def _float32_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


_STORAGE_OF = {v: k for k, v in _TORCH_STORAGES.items()}


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


_ORDERED_DICT = b"ccollections\nOrderedDict\n)R"                   # GLOBAL, (), REDUCE


def _write_torch_bin(path, tensors: dict, views: dict) -> None:
    """A torch.save-compatible zip archive of NumPy arrays, written without torch.

    tensors: {name: (array in its storage dtype, dtype name)}; views: {name: (base
    name, offset, shape, stride)} share the base's storage, as torch views do.
    The pickle is assembled opcode by opcode (protocol 2), so that it names
    torch's globals without importing torch.
    """
    keys = {name: str(i) for i, name in enumerate(tensors)}
    body = [b"\x80\x02", _ORDERED_DICT]

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
                                 b"\x89", _ORDERED_DICT]) + b"R")

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


def _write_safetensors(path, tensors: dict) -> None:
    if all(dtype != "bfloat16" for _, dtype in tensors.values()):
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(a) for k, (a, _) in tensors.items()}, path)
        return
    # safetensors' NumPy API has no bfloat16: write the format directly (header size,
    # JSON header, data), which its reader then parses like any other file.
    code = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name, (data, dtype) in tensors.items():
        raw = np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": code[dtype], "shape": list(data.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def write_official_directory(directory, state_dict: Mapping, config: Mapping, *,
                             format: str = "safetensors", dtype: str = "float32",
                             num_shards: int = 1, views: Mapping | None = None,
                             tokenizer_json=None) -> str:
    """Write a checkpoint directory in the release layout (the inverse of
    `from_official_directory`), with NumPy only.

    Args:
        directory: created if needed.
        state_dict: {name: array}, e.g. from `to_official_state_dict`.
        config: the official config dict, written as config.json.
        format: "safetensors" (model*.safetensors) or "bin" (pytorch_model*.bin,
            a torch.save-compatible zip archive, written without torch).
        dtype: "float32", "float16" or "bfloat16" for the floating-point entries.
        num_shards: > 1 splits the entries over that many files plus an index json.
        views: "bin" only: {name: (base name, offset, shape, stride)} entries
            stored as views of another entry's storage (as the official qkw_m).
        tokenizer_json: a `tokenizers.Tokenizer` (or the JSON text of one), written
            as tokenizer.json.

    Returns:
        The directory.
    """
    if format not in ("safetensors", "bin"):
        raise ValueError(f"`format` must be 'safetensors' or 'bin'. Received: format={format!r}")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError("`dtype` must be 'float32', 'float16' or 'bfloat16'. Received: "
                         f"dtype={dtype!r}")
    if not _is_int(num_shards) or num_shards < 1:
        raise ValueError(f"`num_shards` must be a positive integer. Received: "
                         f"num_shards={num_shards!r}")
    views = dict(views or {})
    if views and format != "bin":
        raise ValueError("`views` are only stored by format='bin'.")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for name, value in state_dict.items():
        a = _to_numpy(name, value)
        if np.issubdtype(a.dtype, np.floating):
            a = _float32_to_bfloat16(a) if dtype == "bfloat16" else a.astype(dtype)
            tensors[str(name)] = (a, dtype)
        else:
            tensors[str(name)] = (a, a.dtype.name)
    for name, (base, *_rest) in views.items():
        if base not in tensors:
            raise ValueError(f"`views[{name!r}]` refers to {base!r}, which is not in state_dict.")
    names = list(tensors)
    num_shards = min(int(num_shards), len(names)) or 1
    ext = "safetensors" if format == "safetensors" else "bin"
    stem = "model" if format == "safetensors" else "pytorch_model"
    weight_map = {}
    for s in range(num_shards):
        part = {n: tensors[n] for n in names[s::num_shards]}
        part_views = {n: v for n, v in views.items() if v[0] in part}
        fname = (f"{stem}.{ext}" if num_shards == 1
                 else f"{stem}-{s + 1:05d}-of-{num_shards:05d}.{ext}")
        path = os.path.join(directory, fname)
        if format == "bin":
            _write_torch_bin(path, part, part_views)
        else:
            _write_safetensors(path, part)
        weight_map.update({n: fname for n in [*part, *part_views]})
    if num_shards > 1:
        with open(os.path.join(directory, f"{stem}.{ext}.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(config), f, indent=1)
    if tokenizer_json is not None:
        text = tokenizer_json if isinstance(tokenizer_json, str) else tokenizer_json.to_str()
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            f.write(text)
    return directory
