"""Official DCFormer PyTorch state dicts <-> `DCFormerLM` (the weights' layout and the config).

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

This module does not import `dcmha.models` (which imports it): the model class is
the one Keras has registered as ``dcmha>DCFormerLM``.
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from dcmha.checkpoints.files import is_int as _is_int
from dcmha.checkpoints.files import short

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


def official_intermediate_size(hidden_dim: int, multiple_of: int = 256) -> int:
    """The official SwiGLU width: int(2 * 4 * hidden_dim / 3) rounded up to `multiple_of`."""
    n = int(2 * 4 * hidden_dim / 3)
    return multiple_of * (-(-n // multiple_of))


def _registered_model_class():
    """`dcmha.models.DCFormerLM`, as Keras has it registered (``import dcmha`` registers
    it once Keras is imported), without importing `dcmha.models` here."""
    import keras

    cls = keras.saving.get_registered_object("dcmha>DCFormerLM")
    if cls is None:
        raise RuntimeError("DCFormerLM is not registered with Keras: import dcmha.models "
                           "before converting a checkpoint.")
    return cls


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
        raise TypeError(f"state_dict[{short(name)}] is not an array or tensor: "
                        f"{type(value).__name__}") from e
    if not np.issubdtype(out.dtype, np.number) or np.issubdtype(out.dtype, np.complexfloating):
        raise TypeError(f"state_dict[{short(name)}] must be a real-valued array or tensor. "
                        f"Received: dtype {out.dtype}")
    return out


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
                                 f"{short(cfg[key])}")


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
        inter = official_intermediate_size(dim, 256)
    window_type = cfg["window_type"] or "LG"
    if not isinstance(window_type, str) or set(window_type) - {"L", "G"}:
        raise ValueError("Unsupported DCFormer config: window_type must be None or a string of "
                         f"'L' and 'G' (e.g. 'LGLL'). Received: {short(cfg['window_type'])}")
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
    sd, kw, args = official_model_arguments(state_dict, config, dtype=dtype, **overrides)
    model = _registered_model_class()(**args)
    model.build((None, None))
    assign_official_state_dict(model, sd, kw)
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
    if kw["num_layers"] > len(sd):   # every layer has entries: checked before any table
        raise ValueError(f"Config 'n_layer' is {kw['num_layers']}, but the state dict holds "
                         f"only {len(sd)} entries (each layer needs several).")
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
                         f"layout for this config): {short(sorted(unexpected)[:4])}"
                         + (f" ({len(unexpected)} in all)" if len(unexpected) > 4 else ""))
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


def assign_official_state_dict(model, sd, kw):
    """Assign the official state dict ``sd`` (NumPy arrays by official name) to ``model``'s
    variables. ``model`` is a `DCFormerLM` or any object with its attributes
    (``tok_embeddings``, ``norm``, ``output_projection``, ``blocks``); ``kw`` gives the
    sizes (``hidden_dim``, ``num_heads``, ``head_dim``, ``num_key_value_heads``) and the
    switches (``attention``, ``qk_norm``), as `official_model_arguments` returns them."""
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


