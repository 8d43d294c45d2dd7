"""The layers of a DCFormer decoder: `SwiGLU`, `DCFormerBlock` (pre-norm causal DCMHA
self-attention then SwiGLU) and `decoder_blocks`, the blocks of a resolved configuration.

    block:  h   = x + attention(attention_norm(x))          (causal self-attention)
            out = h + feed_forward(ffn_norm(h))

Sublayer names follow the official PyTorch checkpoint (``attention_norm``,
``attention``, ``ffn_norm``, ``feed_forward`` with ``w1``/``w3``/``w2``) so that
`dcmha.checkpoints` maps them one to one.
"""

from __future__ import annotations

import keras
from keras import ops

from dcmha.call import check_positive_int
from dcmha.layers import DCMHA
from dcmha.layers.weights import fresh_initializer
from dcmha.models.config import default_intermediate_dim, serialize_arguments

__all__ = ["RMSNorm", "SwiGLU", "DCFormerBlock", "decoder_blocks", "fresh_initializer"]

_register = keras.saving.register_keras_serializable(package="dcmha")

#: RMSNorm x * rsqrt(mean(x**2) + eps) * scale. Keras's own layer computes exactly
#: that (in at least float32), so the models use it rather than a copy.
RMSNorm = keras.layers.RMSNormalization


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
        check_positive_int("intermediate_dim", intermediate_dim)
        self.intermediate_dim = int(intermediate_dim)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        D = input_shape[-1]
        inner = tuple(input_shape[:-1]) + (self.intermediate_dim,)

        def dense(units, name, shape, offset):
            layer = keras.layers.Dense(
                units, use_bias=False, name=name, dtype=self.dtype_policy,
                kernel_initializer=fresh_initializer(self.kernel_initializer, offset=offset))
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
        check_positive_int("num_heads", num_heads)
        check_positive_int("key_dim", key_dim, allow_none=True)
        check_positive_int("intermediate_dim", intermediate_dim, allow_none=True)
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


def decoder_blocks(config, *, kernel_initializer, norm_eps, dtype=None):
    """The `DCFormerBlock`s "layers_<i>" of a resolved configuration (``resolve_config``),
    block i's SwiGLU kernels from a fresh copy of ``kernel_initializer`` (seed + 10 i)."""
    return [DCFormerBlock(config["num_heads"], key_dim=config["head_dim"],
                          intermediate_dim=config["intermediate_dim"], norm_eps=float(norm_eps),
                          kernel_initializer=fresh_initializer(kernel_initializer, offset=10 * i),
                          attention_options=config["layer_options"](i), name=f"layers_{i}",
                          dtype=dtype)
            for i in range(config["num_layers"])]
