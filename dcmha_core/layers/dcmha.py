"""``DCMHA``: the Keras layer (arguments, variables, call, shapes, config).

The math lives in ``dcmha.ops`` (functional, on ``keras.ops``); the layer's other
concerns live beside this module, as mixins of ``DCMHA``: the forward pass
(``forward``), the attention core and its override point (``core``), masks
(``masking``), the decoding cache (``cache``) and the weights by name (``weights``).
"""

from __future__ import annotations

import math
import string

import numpy as np

import keras

from dcmha.layers._checks import (_call_flag, _flash_implementation, _int_tuple, _same_sizes,
                                  _seeded)
from dcmha.layers.axes import _AxesLayout
from dcmha.layers.cache import _CacheMixin
from dcmha.layers.core import _CoreMixin
from dcmha.layers.dynamic_weights import DynamicWeightProjection
from dcmha.layers.forward import _ForwardMixin
from dcmha.layers.masking import _MaskMixin
from dcmha.layers.weights import _WeightsMixin
from dcmha.spec import reference as spec

_BOOL_ARGS = ("pre_compose", "post_compose", "query_wise", "key_wise", "dynamic_projection",
              "dynamic_gating", "static_compose", "gelu_approximate", "qk_norm", "use_bias",
              "cross_attention")


def _projection_equation(bound, outputs):
    """EinsumDense equation (B', L, *bound) x (*bound, *outputs) -> (B', L, *outputs), bias axes."""
    letters = string.ascii_lowercase
    lead, b = letters[:2], letters[2:2 + bound]
    o = letters[2 + bound:2 + bound + outputs]
    return f"{lead}{b},{b}{o}->{lead}{o}", o


@keras.saving.register_keras_serializable(package="dcmha")
class DCMHA(_ForwardMixin, _CoreMixin, _MaskMixin, _CacheMixin, _WeightsMixin,
            keras.layers.Layer):
    """Dynamically Composable Multi-Head Attention (Xiao et al., ICML 2024).

    Multi-head attention whose heads are mixed, per query/key position pair,
    by input-dependent matrices: once on the scores before the softmax
    (``pre_compose``) and once on the probabilities after it
    (``post_compose``). With ``pre_compose=False, post_compose=False`` it is
    ``keras.layers.MultiHeadAttention``: the same constructor and call
    arguments with the same meaning, the same projection sublayers
    (``EinsumDense`` named "query", "key", "value", "attention_output" and
    "gate"), so LoRA, quantization, ``DTypePolicyMap``, regularizers and
    constraints work as they do there (README, "Differences from
    keras.layers.MultiHeadAttention", lists what differs by design).
    ``DCMHA.from_mha`` turns a built MultiHeadAttention into a DCMHA with the
    same output. The math is ``dcmha.spec.reference``; scores, compositions
    and softmax run in float32 under any dtype policy.

    Args:
        num_heads: N, number of query heads.
        key_dim: d, size of each query/key head.
        value_dim: d_v, size of each value head (default ``key_dim``).
        num_key_value_heads: N_kv for grouped-query attention (default N);
            query head n reads key/value head n // (N / N_kv).
        num_groups: G; heads are composed within G groups of M = N / G.
        rank: R of the dynamic low-rank projection.
        dynamic_hidden_dim: K, hidden width of the projection (default 2 * R * M).
        pre_compose, post_compose: compose the scores / the probabilities.
        query_wise, key_wise: use weights computed from the query / key input.
        dynamic_projection: low-rank dynamic terms (w1, w2).
        dynamic_gating: per-head dynamic gates (dd).
        static_compose: a learned static (G, M, M) mix per stage.
        gelu_approximate: tanh GELU (JAX code) or exact erf (PyTorch code).
        qk_norm: RMS-normalise q and k over d with a learned scale.
        rope_max_wavelength: rotary embeddings with this base (None: off).
        sliding_window: keys with |t - s| < sliding_window only (with
            ``use_causal_mask``: the W keys ending at t).
        query_chunk_size: process queries in chunks (bounds memory by
            (B, N, chunk, S); results do not depend on it).
        dropout: dropout rate on the composed attention probabilities.
        use_bias: biases on the projections (default False, as in the paper's
            models; MultiHeadAttention defaults to True).
        output_shape: the output's trailing shape, an int or a tuple of any
            length (default: the query's last dimension D_q).
        attention_axes: the axes of the inputs attention runs over (None: all
            axes but the batch axis and the last one). With several axes the
            attention is over their flattened product (the other axes act as
            batch axes), as in MultiHeadAttention. Negative axes count from
            the end of the input's shape.
        use_gate: gate each head's output by sigmoid(query . W_gate + b)
            before the output projection (MultiHeadAttention's gated
            attention; sublayer "gate").
        flash_attention: MultiHeadAttention's switch, mapped onto
            ``implementation``: None keeps ``implementation``; True takes a
            fused attention core wherever one can run the call
            (``implementation="auto"`` or a fast path named there; like
            MultiHeadAttention it refuses ``dropout`` > 0 and
            ``return_attention_scores``); False runs the plain ``"ops"`` core.
        cross_attention: separate dynamic projections for the query input
            (query_*) and the key input (key_*), which may differ in width.
        implementation: the attention core: "ops" (the plain keras.ops core: every
            backend, every option), the name of a registered fast path (which must be
            able to run the call, else the call raises a ValueError saying why), or
            "auto" (the default): per call, the first fast path of the active backend
            that can run it and is preferred for it, else "ops" (then choosing a query
            chunk size for speed when ``query_chunk_size`` is None). The paths and
            their rules are the registry's (``dcmha.registry``);
            ``dcmha.ops.explain_implementation`` tells, for a call, why each is
            taken or passed over.
        kernel_initializer, bias_initializer: for the projections.
        kernel_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, bias_constraint: for the projections, as in
            MultiHeadAttention (the composition weights have none).
        seed: int or None; seeds dropout and the initializers.

    Call arguments:
        query: (B, T, D_q), or (B, ..., D_q) with ``attention_axes``.
        value: (B, S, D_kv) (same rank as ``query``).
        key: optional (B, S, D_kv); defaults to ``value``.
        attention_mask: True / non-zero = attend; boolean, integer or float
            (float masks attend where non-zero, as MultiHeadAttention's), a
            tensor, NumPy array or nested list. Broadcastable to (B, T, S),
            or (B, N, T, S) for one mask per head (each head's composed
            scores are masked by its own row); smaller ranks are expanded as
            MultiHeadAttention does. Fully masked rows give zero output,
            never NaN.
        use_causal_mask: keys s <= t only (with a cache: s <=
            cache_update_index + t). A bool, an int (non-zero = True) or a
            boolean/integer scalar tensor (also a traced one).
        return_attention_scores: also return the post-composed, masked
            attention probabilities (B, N, T, S) (float32).
        training: dropout on (True) or off.
        cache: dict from ``init_cache`` (decoding): keys, values and key-side
            dynamic weights of S_max positions; S is then S_max.
        cache_update_index: where the new keys are written (a Python int or
            an integer scalar tensor, with 0 <= index and index + T <= S_max);
            None reads the cache without updating it. Out of range it is a
            ValueError whenever its value is known: a Python int always, a
            tensor in eager calls. Under tracing (``jax.jit``, a
            ``tf.function``, ``torch.compile``, an export) a tensor index
            cannot be checked: the call then runs with the index clamped to
            [0, S_max - T] (as XLA's dynamic_update_slice clamps, now on every
            backend), so the cache gets what the clamped index writes, and its
            output is NaN.
        query_mask, value_mask, key_mask: (B, T) / (B, S) masks of the
            inputs' positions (True = real). Keras fills them from the
            inputs' own masks (``Embedding(mask_zero=True)``, ``Masking``);
            they are combined with ``attention_mask`` and the causal mask by
            a logical AND, as in MultiHeadAttention. The output carries the
            query's Keras mask.

    Returns:
        output (B, T) + output_shape; with scores ``(output, scores)``; with a
        cache ``(output, cache)`` or ``(output, scores, cache)``.
    """

    def __init__(self, num_heads, key_dim, value_dim=None, num_key_value_heads=None,
                 num_groups=1, rank=2, dynamic_hidden_dim=None, pre_compose=True,
                 post_compose=True, query_wise=True, key_wise=True, dynamic_projection=True,
                 dynamic_gating=True, static_compose=False, gelu_approximate=True,
                 qk_norm=False, rope_max_wavelength=None, sliding_window=None,
                 query_chunk_size=None, dropout=0.0, use_bias=False, output_shape=None,
                 cross_attention=False, implementation="auto",
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", seed=None,
                 attention_axes=None, use_gate=False, flash_attention=None,
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, **kwargs):
        flags = dict(pre_compose=pre_compose, post_compose=post_compose, query_wise=query_wise,
                     key_wise=key_wise, dynamic_projection=dynamic_projection,
                     dynamic_gating=dynamic_gating, static_compose=static_compose,
                     gelu_approximate=gelu_approximate, qk_norm=qk_norm, use_bias=use_bias,
                     cross_attention=cross_attention)
        for name, v in dict(flags, use_gate=use_gate).items():
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"`{name}` must be a boolean. Received: {name}={v!r}")
        if flash_attention is not None and not isinstance(flash_attention, (bool, np.bool_)):
            raise ValueError("`flash_attention` must be None or a boolean. "
                             f"Received: flash_attention={flash_attention!r}")
        if rope_max_wavelength is not None and (
                isinstance(rope_max_wavelength, bool)
                or not isinstance(rope_max_wavelength, (int, float, np.integer, np.floating))):
            raise ValueError("`rope_max_wavelength` must be None or a positive number. "
                             f"Received: rope_max_wavelength={rope_max_wavelength!r}")
        if rope_max_wavelength is not None and not math.isfinite(rope_max_wavelength):
            raise ValueError("`rope_max_wavelength` must be finite. "
                             f"Received: rope_max_wavelength={rope_max_wavelength!r}")
        self._cfg = spec.Config(
            num_heads=num_heads, key_dim=key_dim, value_dim=value_dim,
            num_key_value_heads=num_key_value_heads, num_groups=num_groups, rank=rank,
            dynamic_hidden_dim=dynamic_hidden_dim, rope_max_wavelength=rope_max_wavelength,
            sliding_window=sliding_window, query_chunk_size=query_chunk_size,
            **{k: bool(v) for k, v in flags.items()}).validate()
        if (isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating))
                or not 0.0 <= dropout < 1.0):
            raise ValueError(f"`dropout` must be a float in [0, 1). Received: dropout={dropout!r}")
        output_dims = axes = None
        if output_shape is not None:
            output_dims = _int_tuple(output_shape, lambda n: n > 0)
            if output_dims is None:
                raise ValueError("`output_shape` must be None, a positive integer or a tuple of "
                                 f"positive integers. Received: output_shape={output_shape!r}")
        if attention_axes is not None:
            axes = _int_tuple(attention_axes, lambda a: True)
            if axes is None or len(set(axes)) != len(axes):
                raise ValueError("`attention_axes` must be None, an integer or a tuple of "
                                 f"distinct integers. Received: attention_axes={attention_axes!r}")
        implementation = _flash_implementation(flash_attention, implementation, dropout)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise ValueError(f"`seed` must be None or an integer. Received: seed={seed!r}")
        super().__init__(**kwargs)
        self.supports_masking = True
        c = self._cfg
        self.num_heads, self.key_dim, self.value_dim = c.N, c.d, c.d_v
        self.num_key_value_heads, self.num_groups, self.rank = c.N_kv, c.G, c.R
        self.dynamic_hidden_dim = dynamic_hidden_dim
        for name, v in flags.items():
            setattr(self, name, bool(v))
        self.use_gate = bool(use_gate)
        self.flash_attention = None if flash_attention is None else bool(flash_attention)
        self.attention_axes = axes
        self.rope_max_wavelength = rope_max_wavelength
        self.sliding_window = sliding_window
        self.query_chunk_size = query_chunk_size
        self.dropout = float(dropout)
        self._output_dims = output_dims
        self.implementation = implementation
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        # Kept apart from Layer.activity_regularizer: as in MultiHeadAttention it
        # applies to the projections' outputs, not to this layer's output.
        self._activity_regularizer = keras.regularizers.get(activity_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = None if seed is None else int(seed)
        self.seed_generator = (keras.random.SeedGenerator(seed, name="dropout_seed")
                               if self.dropout > 0 else None)
        self._slots = spec.slots(c)
        self._query_slots = spec.side_slots(c, "query")
        self._key_slots = spec.side_slots(c, "key")
        self._core_call = None           # the call in progress, for `_compute_attention`

    # ------------------------------------------------------------------ build
    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        shapes = dict(query=tuple(query_shape), value=tuple(value_shape), key=tuple(key_shape))
        for name, shape in shapes.items():
            if len(shape) < 3 or shape[-1] is None:
                raise ValueError(f"DCMHA expects `{name}` of shape (B, L, D) with a known D. "
                                 f"Received: {name}_shape={shape}")
            if shape[-1] <= 0:
                raise ValueError(f"`{name}` must have a positive last dimension D. "
                                 f"Received: {name}_shape={shape}")
        query_shape, value_shape, key_shape = shapes["query"], shapes["value"], shapes["key"]
        if not len(query_shape) == len(value_shape) == len(key_shape):
            raise ValueError("`query`, `value` and `key` must have the same rank. Received: "
                             f"query_shape={query_shape}, value_shape={value_shape}, "
                             f"key_shape={key_shape}")
        if not _same_sizes(value_shape[1:-1], key_shape[1:-1]):
            raise ValueError("`key` and `value` must have the same length. Received: "
                             f"value_shape={value_shape}, key_shape={key_shape}")
        self._layout = _AxesLayout.create(len(query_shape), self.attention_axes)
        self._layout.check_batch_axes(query_shape, value_shape)
        c = self._cfg
        D_q, D_k, D_v = query_shape[-1], key_shape[-1], value_shape[-1]
        if self._slots and not c.cross_attention and D_q != D_k:
            raise ValueError(
                "Self-attention dynamic weights share one projection, so `query` and `key` "
                f"must have the same width. Received: query width {D_q}, key width {D_k}; "
                "use cross_attention=True for separate projections.")
        out_dims = self._output_dims or (D_q,)
        self._dims = dict(query=D_q, key=D_k, value=D_v, output=out_dims)
        N, N_kv, d, d_v, G, M = c.N, c.N_kv, c.d, c.d_v, c.G, c.M
        seed = (lambda i: None) if self.seed is None else (lambda i: self.seed + 100 + i)
        common = dict(kernel_regularizer=self.kernel_regularizer,
                      bias_regularizer=self.bias_regularizer,
                      activity_regularizer=self._activity_regularizer,
                      kernel_constraint=self.kernel_constraint,
                      bias_constraint=self.bias_constraint, dtype=self.dtype_policy)

        def projection(name, width, bound, out, i, activation=None):
            # The inputs reach the projections flattened to (B', L, ...) (see
            # _AxesLayout), so one equation serves every input rank; the kernel
            # and bias shapes are MultiHeadAttention's.
            equation, bias_axes = _projection_equation(bound, len(out))
            layer = keras.layers.EinsumDense(
                equation, output_shape=(None,) + tuple(out),
                bias_axes=bias_axes if c.use_bias else None, activation=activation,
                kernel_initializer=_seeded(self.kernel_initializer, seed(i)),
                bias_initializer=_seeded(self.bias_initializer, seed(i + 4)), name=name,
                **common)
            # The inputs may carry Keras masks, which this layer consumes; the
            # projection passes them on like Dense instead of warning.
            layer.supports_masking = True
            layer.build((None, None) + tuple(width))
            return layer

        # Created in MultiHeadAttention's order, so that with composition off
        # `get_weights()` lists the same arrays in the same order.
        self._query_dense = projection("query", (D_q,), 1, (N, d), 0)
        self._key_dense = projection("key", (D_k,), 1, (N_kv, d), 1)
        self._gate_dense = (projection("gate", (D_q,), 1, (N, d_v), 12, activation="sigmoid")
                            if self.use_gate else None)
        self._value_dense = projection("value", (D_v,), 1, (N_kv, d_v), 2)
        self._output_dense = projection("attention_output", (N, d_v), 2, out_dims, 3)
        self.static_pre = self.static_post = None
        if c.static_compose:
            for i, stage in enumerate(("pre", "post")):
                if getattr(c, stage + "_compose"):
                    init = keras.initializers.RandomNormal(
                        stddev=math.sqrt(1.0 / M) * 0.1, seed=seed(8 + i))
                    setattr(self, "static_" + stage, self.add_weight(
                        name="static_" + stage, shape=(G, M, M), initializer=init,
                        autocast=False))
        if c.qk_norm:
            self.query_norm_scale = self.add_weight(name="query_norm_scale", shape=(d,),
                                                    initializer="ones", autocast=False)
            self.key_norm_scale = self.add_weight(name="key_norm_scale", shape=(d,),
                                                  initializer="ones", autocast=False)

        def dynamic(name, slots, width, i):
            layer = DynamicWeightProjection(
                slots, num_heads=N, num_groups=G, rank=c.R,
                dynamic_hidden_dim=c.dynamic_hidden_dim,
                dynamic_projection=c.dynamic_projection, dynamic_gating=c.dynamic_gating,
                gelu_approximate=c.gelu_approximate, seed=seed(20 + 10 * i),
                dtype=self.dtype_policy, name=name)
            layer.build((None, None, width))
            return layer

        self.dynamic_projection_layer = None
        self.query_dynamic_projection = self.key_dynamic_projection = None
        if c.cross_attention:
            if self._query_slots:
                self.query_dynamic_projection = dynamic(
                    "query_dynamic_projection", self._query_slots, D_q, 0)
            if self._key_slots:
                self.key_dynamic_projection = dynamic(
                    "key_dynamic_projection", self._key_slots, D_k, 1)
        elif self._slots:
            self.dynamic_projection_layer = dynamic("dynamic_projection", self._slots, D_q, 0)

    # ------------------------------------------------ projections (Keras layers)
    # MultiHeadAttention's names for its EinsumDense sublayers.
    query_dense = property(lambda self: self._query_dense)
    key_dense = property(lambda self: self._key_dense)
    value_dense = property(lambda self: self._value_dense)
    output_dense = property(lambda self: self._output_dense)
    gate_dense = property(lambda self: self._gate_dense)

    def _projections(self):
        """{spec prefix: EinsumDense} of the built projections."""
        out = dict(query=self._query_dense, key=self._key_dense, value=self._value_dense,
                   output=self._output_dense)
        if self._gate_dense is not None:
            out["gate"] = self._gate_dense
        return out

    def call(self, query, value, key=None, attention_mask=None, use_causal_mask=False,
             return_attention_scores=False, training=None, cache=None,
             cache_update_index=None, query_mask=None, value_mask=None, key_mask=None):
        return_attention_scores = _call_flag("return_attention_scores", return_attention_scores)
        if return_attention_scores and self.flash_attention:
            raise ValueError("`return_attention_scores=True` cannot be used with "
                             "`flash_attention=True`: fused attention cores do not return "
                             "scores.")
        y, extras, new_cache = self._forward(
            query, value, key, attention_mask=attention_mask, use_causal_mask=use_causal_mask,
            training=training, cache=cache, cache_update_index=cache_update_index,
            scores=return_attention_scores, query_mask=query_mask, value_mask=value_mask,
            key_mask=key_mask)
        out = (y,)
        if return_attention_scores:
            out += (extras["attention_scores"],)
        if cache is not None:
            out += (new_cache,)
        return out[0] if len(out) == 1 else out

    def compute_intermediates(self, query, value, key=None, **kwargs):
        """Output and intermediates of one eager call (for tests and conformance).

        Returns a dict: "output", "attention_scores", "scores", "pre_composed",
        "probs" (B, N, T, S), "query_dynamic"/"key_dynamic" ({slot: {...}}),
        "q", "k", "v" and "cache" (when a cache is given).
        """
        if not self.built:
            self.build(tuple(query.shape), tuple(value.shape),
                       None if key is None else tuple(key.shape))
        y, extras, new_cache = self._forward(query, value, key, scores=True,
                                             intermediates=True, **kwargs)
        extras["output"] = y
        if new_cache is not None:
            extras["cache"] = new_cache
        return extras

    # ---------------------------------------------------------------- shapes
    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return tuple(query_shape[:-1]) + tuple(self._output_dims or (query_shape[-1],))

    def compute_output_spec(self, query, value, key=None, attention_mask=None,
                            use_causal_mask=False, return_attention_scores=False,
                            training=None, cache=None, cache_update_index=None,
                            query_mask=None, value_mask=None, key_mask=None):
        out = (keras.KerasTensor(self.compute_output_shape(query.shape, value.shape),
                                 dtype=self.compute_dtype),)
        if _call_flag("return_attention_scores", return_attention_scores):
            key_shape = (None, cache["key"].shape[1], None) if cache is not None else (
                value.shape if key is None else key.shape)
            shape = self._layout.scores_shape(tuple(query.shape), tuple(key_shape),
                                              self.num_heads)
            out += (keras.KerasTensor(shape, dtype="float32"),)
        if cache is not None:
            out += ({n: keras.KerasTensor(t.shape, dtype=t.dtype) for n, t in cache.items()},)
        return out[0] if len(out) == 1 else out

    # ---------------------------------------------------------------- config
    def get_config(self):
        c = self._cfg
        return {
            **super().get_config(),
            "num_heads": c.num_heads, "key_dim": c.key_dim, "value_dim": c.value_dim,
            "num_key_value_heads": c.num_key_value_heads, "num_groups": c.num_groups,
            "rank": c.rank, "dynamic_hidden_dim": c.dynamic_hidden_dim,
            **{n: getattr(c, n) for n in _BOOL_ARGS},
            "rope_max_wavelength": c.rope_max_wavelength, "sliding_window": c.sliding_window,
            "query_chunk_size": c.query_chunk_size, "dropout": self.dropout,
            "output_shape": (self._output_dims[0] if self._output_dims and
                             len(self._output_dims) == 1 else self._output_dims),
            "implementation": self.implementation,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "seed": self.seed, "attention_axes": self.attention_axes,
            "use_gate": self.use_gate, "flash_attention": self.flash_attention,
            "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
            "activity_regularizer": keras.regularizers.serialize(self._activity_regularizer),
            "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
            "bias_constraint": keras.constraints.serialize(self.bias_constraint),
        }

    @property
    def spec_config(self):
        """The spec's ``reference.Config`` of this layer."""
        return self._cfg
