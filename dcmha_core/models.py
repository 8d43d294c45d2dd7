"""DCFormer language models built from the `DCMHA` layer.

A DCFormer (Xiao et al., ICML 2024) is a Transformer++ (pre-norm RMSNorm,
rotary embeddings, SwiGLU MLP, no biases) whose attention is DCMHA. With
``attention="mha"`` every composition is switched off and the same class is
the Transformer++ baseline with identical everything else.

    block:  h   = x + attention(attention_norm(x))          (causal self-attention)
            out = h + feed_forward(ffn_norm(h))
    model:  logits = output(norm(blocks(tok_embeddings(token_ids))))

Rotary embeddings and QK-norm are applied inside the attention layer
(``rope_max_wavelength``, ``qk_norm``). Sublayer names follow the official
PyTorch checkpoint (``tok_embeddings``, ``layers_<i>``, ``attention_norm``,
``attention``, ``ffn_norm``, ``feed_forward`` with ``w1``/``w3``/``w2``,
``norm``, ``output``) so that `dcmha.checkpoints` maps them one to one.
"""

from __future__ import annotations

import inspect
import math

import numpy as np

import keras
from keras import ops

from dcmha import backend as seam
from dcmha import checkpoints
from dcmha.checkpoints import official_intermediate_size
from dcmha.layers import DCMHA, readable_value

__all__ = [
    "RMSNorm", "SwiGLU", "DCFormerBlock", "DCFormerLM", "PRESETS",
    "official_intermediate_size", "default_intermediate_dim", "count_parameters",
    "resolve_config", "decoder_blocks", "fresh_initializer", "serialize_arguments",
]

_register = keras.saving.register_keras_serializable(package="dcmha")

#: RMSNorm x * rsqrt(mean(x**2) + eps) * scale. Keras's own layer computes exactly
#: that (in at least float32), so the models use it rather than a copy.
RMSNorm = keras.layers.RMSNormalization

#: DCMHA arguments that the model owns; everything else in ``**dcmha_options``
#: goes to every attention layer unchanged.
_MODEL_OWNED = ("num_heads", "key_dim", "value_dim", "num_key_value_heads", "num_groups",
                "qk_norm", "rope_max_wavelength", "sliding_window", "output_shape",
                "cross_attention", "attention_axes", "name", "dtype")


def _check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        kind = "None or a positive integer" if allow_none else "a positive integer"
        raise ValueError(f"`{name}` must be {kind}. Received: {name}={value!r}")


def default_intermediate_dim(hidden_dim: int) -> int:
    """`intermediate_dim` when None: the official rule (multiple of 256) for
    hidden_dim >= 512; below that a multiple of 32, so that a tiny model is not
    padded to several times the intended 8/3 * hidden_dim width."""
    return official_intermediate_size(hidden_dim, 256 if hidden_dim >= 512 else 32)


def fresh_initializer(initializer, offset=0):
    """A new instance of `initializer`; a seeded one gets seed + offset, because
    one seeded initializer used twice gives two identical tensors."""
    config = keras.initializers.serialize(keras.initializers.get(initializer))
    inner = config.get("config", {}) if isinstance(config, dict) else {}
    if inner.get("seed") is not None:
        inner["seed"] = int(inner["seed"]) + offset
    return keras.initializers.get(config)


def _check_token_range(ids, vocab_size):
    """ValueError when a token id (NumPy array) is outside [0, vocab_size)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"`token_ids` must be in [0, vocab_size) = [0, {vocab_size}). "
                         f"Received: token_ids with min={ids.min()}, max={ids.max()}")


def serialize_arguments(arguments):
    """``arguments`` ({name: value}) for a ``get_config``: plain values as they are, Keras
    objects (initializers, ...) serialised."""
    return {k: v if isinstance(v, (str, int, float, bool, type(None), list, tuple, dict))
            else keras.saving.serialize_keras_object(v) for k, v in arguments.items()}


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------

@_register
class SwiGLU(keras.layers.Layer):
    """SwiGLU feed-forward: w2(silu(w1(x)) * w3(x)), no biases.

    Args:
        intermediate_dim: width of the gate (`w1`) and up (`w3`) projections.
        kernel_initializer: initializer of the three kernels.

    Call arguments:
        x: (B, T, D). Returns (B, T, D).
    """

    def __init__(self, intermediate_dim, kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        _check_positive_int("intermediate_dim", intermediate_dim)
        self.intermediate_dim = int(intermediate_dim)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        D = input_shape[-1]
        inner = tuple(input_shape[:-1]) + (self.intermediate_dim,)

        def dense(units, name, shape, offset):
            layer = keras.layers.Dense(
                units, use_bias=False, name=name, dtype=self.dtype_policy,
                kernel_initializer=fresh_initializer(self.kernel_initializer, offset))
            layer.build(shape)
            return layer

        self.w1 = dense(self.intermediate_dim, "w1", input_shape, 1)   # gate
        self.w3 = dense(self.intermediate_dim, "w3", input_shape, 3)   # up
        self.w2 = dense(D, "w2", inner, 2)                             # down

    def call(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "intermediate_dim": self.intermediate_dim,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}


@_register
class DCFormerBlock(keras.layers.Layer):
    """One pre-norm decoder block: causal DCMHA self-attention then SwiGLU.

        h = x + attention(attention_norm(x));  out = h + feed_forward(ffn_norm(h))

    Args:
        num_heads: query heads N.
        key_dim: head size d; None -> D // num_heads.
        intermediate_dim: SwiGLU width; None -> `default_intermediate_dim(D)`.
        norm_eps: epsilon of the two RMSNorms.
        kernel_initializer: initializer of the SwiGLU kernels.
        attention_options: dict of further `DCMHA` arguments (num_key_value_heads,
            num_groups, rank, qk_norm, rope_max_wavelength, sliding_window, the
            composition switches, ...). `output_shape` is always D.

    Call arguments:
        x: (B, T, D).
        training: Python bool.
        cache: the attention layer's decoding cache (see `DCMHA.init_cache`), or None.
        cache_update_index: position of x[:, 0] in the cache (with `cache`).

    Returns:
        (B, T, D), or ((B, T, D), new_cache) when `cache` is given.
    """

    def __init__(self, num_heads, key_dim=None, intermediate_dim=None, norm_eps=1e-6,
                 kernel_initializer="glorot_uniform", attention_options=None, **kwargs):
        super().__init__(**kwargs)
        _check_positive_int("num_heads", num_heads)
        _check_positive_int("key_dim", key_dim, allow_none=True)
        _check_positive_int("intermediate_dim", intermediate_dim, allow_none=True)
        if not norm_eps > 0:
            raise ValueError(f"`norm_eps` must be positive. Received: norm_eps={norm_eps!r}")
        self.num_heads = int(num_heads)
        self.key_dim = None if key_dim is None else int(key_dim)
        self.intermediate_dim = None if intermediate_dim is None else int(intermediate_dim)
        self.norm_eps = float(norm_eps)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.attention_options = dict(attention_options or {})
        bad = sorted(set(self.attention_options) & {"num_heads", "key_dim", "output_shape",
                                                     "cross_attention", "name", "dtype"})
        if bad:
            raise ValueError(f"`attention_options` may not set {bad}; they are fixed by the block.")

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        D = input_shape[-1]
        key_dim = self.key_dim or D // self.num_heads
        if key_dim <= 0:
            raise ValueError(f"Hidden size {D} is smaller than num_heads={self.num_heads}; "
                             "pass `key_dim`.")
        intermediate = self.intermediate_dim or default_intermediate_dim(D)
        kw = dict(dtype=self.dtype_policy)
        self.attention_norm = RMSNorm(epsilon=self.norm_eps, name="attention_norm", **kw)
        self.attention_norm.build(input_shape)
        self.attention = DCMHA(num_heads=self.num_heads, key_dim=key_dim, name="attention",
                               **self.attention_options, **kw)
        self.attention.build(input_shape, input_shape)
        self.ffn_norm = RMSNorm(epsilon=self.norm_eps, name="ffn_norm", **kw)
        self.ffn_norm.build(input_shape)
        self.feed_forward = SwiGLU(intermediate, kernel_initializer=fresh_initializer(
            self.kernel_initializer), name="feed_forward", **kw)
        self.feed_forward.build(input_shape)

    def call(self, x, training=None, cache=None, cache_update_index=None):
        h = self.attention_norm(x)
        if cache is None:
            a = self.attention(h, h, use_causal_mask=True, training=training)
        else:
            a, cache = self.attention(h, h, use_causal_mask=True, training=training,
                                      cache=cache, cache_update_index=cache_update_index)
        h = x + a
        out = h + self.feed_forward(self.ffn_norm(h))
        return out if cache is None else (out, cache)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
                "intermediate_dim": self.intermediate_dim, "norm_eps": self.norm_eps,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "attention_options": serialize_arguments(self.attention_options)}


# ---------------------------------------------------------------------------
# The language model
# ---------------------------------------------------------------------------

#: Preset configurations for `DCFormerLM.from_preset` (parameter counts there).
PRESETS = {
    "dcformer_tiny": dict(vocab_size=256, num_layers=4, hidden_dim=128, num_heads=4,
                          sliding_window=64, window_pattern="LG", rope_max_wavelength=10000),
    "dcformer_405m": dict(vocab_size=50432, num_layers=24, hidden_dim=1024, num_heads=16,
                          sliding_window=256, window_pattern="LG", rope_max_wavelength=10000),
    "dcformer_2.8b": dict(vocab_size=50432, num_layers=32, hidden_dim=2560, num_heads=32,
                          sliding_window=256, window_pattern="LG", qk_norm=True,
                          rope_max_wavelength=10000),
}


def _attention_param_count(D, N, N_kv, d, d_v, opts):
    """Parameter count of one self-attention DCMHA layer (spec param_shapes)."""
    from dcmha.spec import reference
    names = {f for f in reference.Config.__dataclass_fields__}
    cfg = reference.Config(num_heads=N, key_dim=d, value_dim=d_v, num_key_value_heads=N_kv,
                           **{k: v for k, v in opts.items()
                              if k in names and k != "num_key_value_heads"})
    return sum(int(np.prod(s)) for s in reference.param_shapes(cfg, D, D).values())


def count_parameters(**config) -> int:
    """Parameter count of `DCFormerLM(**config)` without building it (any size)."""
    config = {k: v for k, v in config.items() if k not in ("name", "dtype", "trainable")}
    spec = resolve_config(**config)
    V, L, D = spec["vocab_size"], spec["num_layers"], spec["hidden_dim"]
    total = V * D + D + (0 if spec["tie_embeddings"] else V * D)
    for i in range(L):
        opts = spec["layer_options"](i)
        attn = _attention_param_count(D, spec["num_heads"], opts.get("num_key_value_heads")
                                      or spec["num_heads"], spec["head_dim"], spec["head_dim"],
                                      opts)
        total += attn + 2 * D + 3 * D * spec["intermediate_dim"]
    return total


def resolve_config(vocab_size, num_layers, hidden_dim, num_heads, intermediate_dim=None,
             num_key_value_heads=None, num_groups=1, head_dim=None, sliding_window=None,
             window_pattern="LG", qk_norm=False, rope_max_wavelength=10000, norm_eps=1e-6,
             tie_embeddings=False, attention="dcmha", kernel_initializer=None,
             **dcmha_options):
    """Validate `DCFormerLM`'s arguments; return the derived sizes and the per-layer DCMHA
    options: {"vocab_size", "num_layers", "hidden_dim", "num_heads", "head_dim",
    "intermediate_dim", "tie_embeddings", "layer_options"}, where ``layer_options(i)`` is
    the ``attention_options`` of block i. `DCFormerLM` and `dcmha.hub.DCFormerBackbone`
    build their blocks from it (``decoder_blocks``)."""
    for name, value in (("vocab_size", vocab_size), ("num_layers", num_layers),
                        ("hidden_dim", hidden_dim), ("num_heads", num_heads),
                        ("num_groups", num_groups)):
        _check_positive_int(name, value)
    for name, value in (("intermediate_dim", intermediate_dim), ("head_dim", head_dim),
                        ("num_key_value_heads", num_key_value_heads),
                        ("sliding_window", sliding_window)):
        _check_positive_int(name, value, allow_none=True)
    if head_dim is None and hidden_dim % num_heads:
        raise ValueError("`hidden_dim` must be divisible by `num_heads` when `head_dim` is "
                         f"None. Received: hidden_dim={hidden_dim}, num_heads={num_heads}")
    if (not isinstance(window_pattern, str) or not window_pattern
            or set(window_pattern) - {"L", "G"}):
        raise ValueError("`window_pattern` must be a non-empty string of 'L' (local) and "
                         f"'G' (global). Received: window_pattern={window_pattern!r}")
    if attention not in ("dcmha", "mha"):
        raise ValueError(f"`attention` must be 'dcmha' or 'mha'. Received: "
                         f"attention={attention!r}")
    if rope_max_wavelength is not None and not rope_max_wavelength > 0:
        raise ValueError("`rope_max_wavelength` must be None or positive. Received: "
                         f"rope_max_wavelength={rope_max_wavelength!r}")
    owned = sorted(set(dcmha_options) & set(_MODEL_OWNED))
    if owned:
        raise ValueError(f"{owned} are set by DCFormerLM itself and cannot be passed as "
                         "DCMHA options (use hidden_dim, num_heads, head_dim, ...).")
    accepted = set(inspect.signature(DCMHA.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(dcmha_options) - accepted)
    if unknown:
        raise ValueError(f"Unknown DCFormerLM arguments: {unknown}. Accepted DCMHA options: "
                         f"{sorted(accepted - set(_MODEL_OWNED))}")
    options = dict(dcmha_options)
    if attention == "mha":
        on = [k for k in ("pre_compose", "post_compose") if options.get(k)]
        if on:
            raise ValueError(f"attention='mha' switches composition off; it cannot be "
                             f"combined with {on}=True.")
        options.update(pre_compose=False, post_compose=False)
    d = head_dim or hidden_dim // num_heads
    intermediate = intermediate_dim or default_intermediate_dim(hidden_dim)

    def layer_options(i):
        local = sliding_window is not None and window_pattern[i % len(window_pattern)] == "L"
        out = dict(options, num_groups=num_groups, qk_norm=bool(qk_norm),
                   rope_max_wavelength=rope_max_wavelength,
                   sliding_window=sliding_window if local else None)
        if options.get("seed") is not None:
            # One seed per layer: equal seeds would give every layer equal weights.
            out["seed"] = int(options["seed"]) + 1000 * i
        if num_key_value_heads is not None:
            out["num_key_value_heads"] = num_key_value_heads
        return out

    return dict(vocab_size=int(vocab_size), num_layers=int(num_layers),
                hidden_dim=int(hidden_dim), num_heads=int(num_heads), head_dim=int(d),
                intermediate_dim=int(intermediate), tie_embeddings=bool(tie_embeddings),
                layer_options=layer_options)


def decoder_blocks(config, *, kernel_initializer, norm_eps, dtype=None):
    """The `DCFormerBlock`s "layers_<i>" of a resolved configuration (``resolve_config``),
    block i's SwiGLU kernels from a fresh copy of ``kernel_initializer`` (seed + 10 i)."""
    return [DCFormerBlock(config["num_heads"], key_dim=config["head_dim"],
                          intermediate_dim=config["intermediate_dim"], norm_eps=float(norm_eps),
                          kernel_initializer=fresh_initializer(kernel_initializer, 10 * i),
                          attention_options=config["layer_options"](i), name=f"layers_{i}",
                          dtype=dtype)
            for i in range(config["num_layers"])]


@_register
class DCFormerLM(keras.Model):
    """A causal DCFormer language model: token ids (B, T) -> logits (B, T, V).

    Args:
        vocab_size: V.
        num_layers: number of blocks L.
        hidden_dim: model width D.
        num_heads: query heads N per layer.
        intermediate_dim: SwiGLU width; None -> int(8 * D / 3) rounded up to a
            multiple of 256 (the official rule) when D >= 512, of 32 below.
        num_key_value_heads: N_kv (GQA); None -> N.
        num_groups: composition groups G.
        head_dim: head size d; None -> D // N.
        sliding_window: window W of the local layers; None -> every layer global.
        window_pattern: string of "L" (local) and "G" (global) repeated over the
            layers: "LG" makes even layers local and odd layers global; "LGLL"
            gives [L, G, L, L, L, G, L, L, ...]. Ignored when sliding_window is None.
        qk_norm: QK-norm in every attention layer.
        rope_max_wavelength: RoPE base; None switches RoPE off.
        norm_eps: epsilon of every RMSNorm block norm (QK-norm keeps 1e-6).
        tie_embeddings: reuse the token embedding as the output projection.
        attention: "dcmha", or "mha" for the Transformer++ baseline (the same
            model with pre_compose=False, post_compose=False).
        kernel_initializer: initializer of the SwiGLU kernels (and the output
            projection).
        **dcmha_options: further `DCMHA` arguments given to every attention layer
            (rank, dynamic_hidden_dim, pre_compose, post_compose, query_wise,
            key_wise, dynamic_projection, dynamic_gating, static_compose,
            gelu_approximate, query_chunk_size, dropout, implementation, ...),
            plus the Keras `name` / `dtype` / `trainable`.

    Call arguments:
        token_ids: int (B, T), each in [0, vocab_size): outside it a ValueError
            in eager calls; under tracing (``jax.jit``, a ``tf.function``,
            ``torch.compile``, an export), where the values are unknown, the
            logits at the positions of such ids are NaN.
        training: Python bool.
        cache: list of per-layer decoding caches (`init_cache`), or None.
        cache_update_index: position of token_ids[:, 0] (Python int or int32
            scalar tensor) when `cache` is given; out of range it is a
            ValueError when known, else see `DCMHA` (clamped write, NaN output).

    Returns:
        logits (B, T, V) in the compute dtype; with a cache (logits, new cache).

    Decoding: `generate` (greedy or sampled, one cached step per token),
    `init_cache` / `call_with_cache` for a custom loop. `as_functional` gives
    the same network as a functional model (e.g. for `dcmha.export.to_onnx`).
    """

    def __init__(self, vocab_size, num_layers, hidden_dim, num_heads, intermediate_dim=None,
                 num_key_value_heads=None, num_groups=1, head_dim=None, sliding_window=None,
                 window_pattern="LG", qk_norm=False, rope_max_wavelength=10000, norm_eps=1e-6,
                 tie_embeddings=False, attention="dcmha", kernel_initializer="glorot_uniform",
                 **dcmha_options):
        base = {k: dcmha_options.pop(k) for k in ("name", "dtype", "trainable")
                if k in dcmha_options}
        super().__init__(**base)
        spec = resolve_config(
            vocab_size=vocab_size, num_layers=num_layers, hidden_dim=hidden_dim,
            num_heads=num_heads, intermediate_dim=intermediate_dim,
            num_key_value_heads=num_key_value_heads, num_groups=num_groups, head_dim=head_dim,
            sliding_window=sliding_window, window_pattern=window_pattern, qk_norm=qk_norm,
            rope_max_wavelength=rope_max_wavelength, norm_eps=norm_eps,
            tie_embeddings=tie_embeddings, attention=attention, **dcmha_options)
        self.vocab_size = spec["vocab_size"]
        self.num_layers = spec["num_layers"]
        self.hidden_dim = spec["hidden_dim"]
        self.num_heads = spec["num_heads"]
        self.intermediate_dim = intermediate_dim
        self.num_key_value_heads = num_key_value_heads
        self.num_groups = num_groups
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.window_pattern = window_pattern
        self.qk_norm = bool(qk_norm)
        self.rope_max_wavelength = rope_max_wavelength
        self.norm_eps = float(norm_eps)
        self.tie_embeddings = bool(tie_embeddings)
        self.attention = attention
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.dcmha_options = dict(dcmha_options)

        kw = dict(dtype=self.dtype_policy)
        self.tok_embeddings = keras.layers.Embedding(
            self.vocab_size, self.hidden_dim, name="tok_embeddings", **kw)
        self.blocks = decoder_blocks(spec, kernel_initializer=self.kernel_initializer,
                                     norm_eps=self.norm_eps, dtype=self.dtype_policy)
        self.norm = RMSNorm(epsilon=self.norm_eps, name="norm", **kw)
        self.output_projection = None if self.tie_embeddings else keras.layers.Dense(
            self.vocab_size, use_bias=False, kernel_initializer=self._initializer(7),
            name="output", **kw)

    # ---- configuration -------------------------------------------------
    def _initializer(self, offset=0):
        return fresh_initializer(self.kernel_initializer, offset)

    def layer_sliding_windows(self):
        """The sliding window of each layer (None = global), e.g. [64, None, 64, None]."""
        return [b.attention_options["sliding_window"] for b in self.blocks]

    @classmethod
    def from_preset(cls, name, **overrides):
        """Build a preset configuration (random weights), with any argument overridden.

        Presets (parameter counts from `count_parameters`, untied embeddings;
        the "mha" column is the same preset with ``attention="mha"``):

        =============  ======  ====  ==  ==  ======  ========  =============  =============
        name           layers  D     N   d   vocab   window    DCFormer       Transformer++
        =============  ======  ====  ==  ==  ======  ========  =============  =============
        dcformer_tiny  4       128   4   32  256     64, LG    914,560        869,504
        dcformer_405m  24      1024  16  64  50432   256, LG   419,873,792    411,616,256
        dcformer_2.8b  32      2560  32  80  50432   256, LG   2,850,463,232  2,795,937,280
        =============  ======  ====  ==  ==  ======  ========  =============  =============

        dcformer_405m has the paper's 405M shape (24 x 1024, 16 heads; SwiGLU
        2816); its 103M embedding + output parameters are included above.
        dcformer_2.8b follows the released DCFormer-2.8B configuration (QK-norm,
        SwiGLU 6912, RoPE base 10000). DCMHA adds dw1 + qkw + dd per layer:
        11,264 (tiny), 344,064 (405m) and 1,703,936 (2.8b): about 2% of the two
        large models, 5% of the tiny one.

        Example: ``DCFormerLM.from_preset("dcformer_tiny", attention="mha")``.

        `name` may also be a checkpoint directory in the authors' release layout
        (config.json plus pytorch_model*.bin or model*.safetensors, sharded or
        not) or an ``hf://owner/name`` handle: the released weights, loaded by
        `dcmha.checkpoints.from_official_directory` (overrides such as ``dtype``
        or ``query_chunk_size`` go to it).
        """
        import os
        if isinstance(name, os.PathLike) or (isinstance(name, str) and (
                name.startswith("hf://") or os.path.isdir(name))):
            return checkpoints.from_official_directory(name, **overrides)
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}. Available: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def get_config(self):
        base = {k: v for k, v in super().get_config().items()
                if k in ("name", "trainable", "dtype")}
        return {**base, "vocab_size": self.vocab_size, "num_layers": self.num_layers,
                "hidden_dim": self.hidden_dim, "num_heads": self.num_heads,
                "intermediate_dim": self.intermediate_dim,
                "num_key_value_heads": self.num_key_value_heads,
                "num_groups": self.num_groups, "head_dim": self.head_dim,
                "sliding_window": self.sliding_window, "window_pattern": self.window_pattern,
                "qk_norm": self.qk_norm, "rope_max_wavelength": self.rope_max_wavelength,
                "norm_eps": self.norm_eps, "tie_embeddings": self.tie_embeddings,
                "attention": self.attention,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                **serialize_arguments(self.dcmha_options)}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    # ---- forward -------------------------------------------------------
    def build(self, input_shape=None):
        input_shape = tuple(input_shape) if input_shape is not None else (None, None)
        hidden = input_shape + (self.hidden_dim,)
        self.tok_embeddings.build(input_shape)
        for block in self.blocks:
            block.build(hidden)
        self.norm.build(hidden)
        if self.output_projection is not None:
            self.output_projection.build(hidden)
        self.built = True

    def _head(self, x):
        x = self.norm(x)
        if self.output_projection is not None:
            return self.output_projection(x)
        emb = ops.cast(self.tok_embeddings.embeddings, x.dtype)
        return ops.matmul(x, ops.transpose(emb))

    def call(self, token_ids, training=None, cache=None, cache_update_index=None):
        values = readable_value(token_ids)
        if values is not None:
            _check_token_range(values, self.vocab_size)
            x = self.tok_embeddings(token_ids)
        else:
            # Traced (jit, tf.function, export): the ids cannot be checked. An id
            # outside [0, V) is looked up as 0 and its position's embedding made
            # NaN, so that its logits are NaN on every backend (instead of NaN on
            # jax, a wrapped row for negative ids, an indexing error on torch).
            ids = ops.cast(token_ids, "int32")
            bad = ops.logical_or(ops.less(ids, 0), ops.greater_equal(ids, self.vocab_size))
            x = self.tok_embeddings(ops.where(bad, 0, ids))
            x = ops.where(bad[..., None], ops.cast(float("nan"), x.dtype), x)
        if cache is None:
            for block in self.blocks:
                x = block(x, training=training)
            return self._head(x)
        new_cache = []
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block(x, training=training, cache=layer_cache,
                                   cache_update_index=cache_update_index)
            new_cache.append(layer_cache)
        return self._head(x), new_cache

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.vocab_size,)

    def as_functional(self, name=None):
        """A functional `keras.Model` over the same layers: token_ids (B, T) -> logits.

        Every layer (and weight) is shared with this model, except with tied
        embeddings, where the output layer is a Dense holding a copy of the
        embedding matrix (transposed). Made of standard Keras layers plus DCMHA,
        so that `dcmha.export.to_onnx` can walk it.
        """
        if not self.built:
            self.build((None, None))
        def block_model(b):
            # One nested functional model per block: layer names repeat across
            # blocks, and a functional model needs unique names at each level.
            x = keras.Input((None, self.hidden_dim), name="x", dtype=self.compute_dtype)
            h = b.attention_norm(x)
            h = keras.layers.Add(name="attention_residual")(
                [x, b.attention(h, h, use_causal_mask=True)])
            f = b.ffn_norm(h)
            ff = b.feed_forward
            gate = keras.layers.Activation("silu", name="silu")(ff.w1(f))
            inner = keras.layers.Multiply(name="swiglu")([gate, ff.w3(f)])
            out = keras.layers.Add(name="ffn_residual")([h, ff.w2(inner)])
            return keras.Model(x, out, name=b.name)

        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        x = self.tok_embeddings(token_ids)
        for b in self.blocks:
            x = block_model(b)(x)
        x = self.norm(x)
        head = self.output_projection
        if head is None:
            head = keras.layers.Dense(self.vocab_size, use_bias=False, name="output",
                                      dtype=self.dtype_policy)
            head.build((None, None, self.hidden_dim))
            head.kernel.assign(ops.transpose(self.tok_embeddings.embeddings))
        return keras.Model(token_ids, head(x), name=name or f"{self.name}_functional")

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
               **kwargs):
        """Keras's `Model.export`, for token ids of any batch size and length by default.

        Without `input_signature` the artifact takes one int32 (B, T) input
        "token_ids" with B and T dynamic (Keras alone would take T from the
        first call and a float dtype from the policy). The backend prepares its
        exporter first (``dcmha.backend.prepare_export``: on torch, ONNX's
        TorchScript exporter learns `aten::rms_norm`). Exports the forward pass
        without a cache: token_ids -> logits (B, T, V).
        """
        if not self.built:
            self.build((None, None))
        if input_signature is None:
            input_signature = [keras.InputSpec(shape=(None, None), dtype="int32",
                                               name="token_ids")]
        seam.prepare_export(format)
        return super().export(filepath, format=format, verbose=verbose,
                              input_signature=input_signature, **kwargs)

    # ---- decoding ------------------------------------------------------
    def init_cache(self, batch_size, max_length, dtype=None):
        """One zero decoding cache per layer (list of dicts, see `DCMHA.init_cache`):
        keys, values and key-side dynamic weights for `max_length` positions."""
        if not self.built:
            self.build((batch_size, None))
        return [b.attention.init_cache(batch_size, max_length, dtype=dtype) for b in self.blocks]

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """Logits of new tokens (B, T_new) at positions cache_update_index + arange(T_new).

        Reads and updates `cache` (from `init_cache`): the new tokens attend to
        every cached position before them, so nothing is recomputed.
        `cache_update_index` may be a Python int or an int32 scalar tensor.
        Returns (logits (B, T_new, V), new cache).
        """
        return self.call(token_ids, cache=cache, cache_update_index=cache_update_index)

    def _decode_function(self):
        """(tokens, cache, index) -> (last logits (B, V) float32, cache), compiled
        where that pays (``dcmha.backend.decode_step``); ``generate`` gives it the
        index as ``dcmha.backend.step_index`` makes it."""
        return seam.decode_step(self)

    def generate(self, token_ids, max_new_tokens, temperature=0.0, seed=None):
        """Continue `token_ids` (B, T) by `max_new_tokens` tokens.

        One prefill of the prompt, then one cached step per new token (keys,
        values and key-side dynamic weights of earlier positions are never
        recomputed). temperature 0 is greedy (argmax); > 0 samples from
        softmax(logits / temperature) with `seed`. On jax and tensorflow the
        step is compiled once per call of `generate`.

        Returns:
            int32 NumPy array (B, T + max_new_tokens): the prompt then the new tokens.
        """
        ids = np.asarray(token_ids if isinstance(token_ids, np.ndarray)
                         else ops.convert_to_numpy(token_ids))
        if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("`token_ids` must be an integer array of shape (B, T) with T >= 1. "
                             f"Received: shape={ids.shape}, dtype={ids.dtype}")
        if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
                or max_new_tokens < 0):
            raise ValueError("`max_new_tokens` must be a non-negative integer. Received: "
                             f"max_new_tokens={max_new_tokens!r}")
        if (isinstance(temperature, bool)
                or not isinstance(temperature, (int, float, np.integer, np.floating))
                or not math.isfinite(temperature) or temperature < 0):
            raise ValueError("`temperature` must be a finite number >= 0. "
                             f"Received: temperature={temperature!r}")
        _check_token_range(ids, self.vocab_size)
        ids = ids.astype("int32")
        B, T = ids.shape
        if max_new_tokens == 0:
            return ids
        if not self.built:
            self.build((B, None))
        step = self._decode_function()
        rng = keras.random.SeedGenerator(seed) if temperature > 0 else None

        index = seam.step_index
        cache = self.init_cache(B, T + max_new_tokens)
        last, cache = step(ops.convert_to_tensor(ids), cache, index(0))      # prefill
        out = [ids]
        for i in range(max_new_tokens):
            if temperature > 0:
                tok = keras.random.categorical(last / temperature, 1, seed=rng, dtype="int32")
            else:
                tok = ops.expand_dims(ops.cast(ops.argmax(last, axis=-1), "int32"), -1)
            tok = np.asarray(ops.convert_to_numpy(tok), dtype="int32")
            out.append(tok)
            if i + 1 < max_new_tokens:
                last, cache = step(ops.convert_to_tensor(tok), cache, index(T + i))
        return np.concatenate(out, axis=1)
