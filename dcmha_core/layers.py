"""DCMHA as Keras 3 layers: ``DCMHA`` and its ``DynamicWeightProjection``.

The math lives in ``dcmha.ops`` (functional, on ``keras.ops``); this module
owns the variables, their canonical (spec) names, masks, the decoding cache and
the Keras plumbing (config, build, symbolic shapes, dtype policies).
"""

from __future__ import annotations

import collections.abc
import math

import numpy as np

import keras
from keras import ops

from dcmha import ops as dops
from dcmha.spec import reference as spec

_BOOL_ARGS = ("pre_compose", "post_compose", "query_wise", "key_wise", "dynamic_projection",
              "dynamic_gating", "static_compose", "gelu_approximate", "qk_norm", "use_bias",
              "cross_attention")


def _seeded(initializer, seed):
    """A fresh copy of ``initializer``, seeded with ``seed`` if it has no seed.

    Keras initializers are stateless once seeded, so each variable gets its own
    copy (and its own seed) to avoid identical values.
    """
    config = initializer.get_config()
    if seed is not None and "seed" in config and config["seed"] is None:
        config["seed"] = seed
    return initializer.__class__.from_config(config)


@keras.saving.register_keras_serializable(package="dcmha")
class DynamicWeightProjection(keras.layers.Layer):
    """Projects an attention input to the dynamic composition weights of its slots.

    h = gelu(x . dw1); w = h . qkw; w1 = rms_norm_M(w[:R]), w2 = w[R:];
    dd = tanh(x . dd). Computed in float32 whatever the dtype policy.

    Args:
        slots: slot names (a subset of ``reference.ALL_SLOTS``), in the order
            of the C axis of the variables.
        num_heads: N (query heads).
        num_groups: G.
        rank: R.
        dynamic_hidden_dim: K (None: 2 * R * M).
        dynamic_projection: create dw1 (D, G, C, K) and qkw (G, C, K, 2R, M).
        dynamic_gating: create dd (D, G, C*M).
        gelu_approximate: tanh GELU (True) or exact erf GELU.
        seed: int or None, seeds the initializers (N(0, sigma) as in the spec).

    Call arguments:
        inputs: (B, L, D).
        slots: optional subset of ``slots`` to compute (default: all).

    Returns:
        ``{slot: {"w1": (B, L, G, R, M), "w2": (B, L, G, R, M), "dd": (B, L, G, M)}}``.
    """

    def __init__(self, slots, num_heads, num_groups=1, rank=2, dynamic_hidden_dim=None,
                 dynamic_projection=True, dynamic_gating=True, gelu_approximate=True,
                 seed=None, **kwargs):
        super().__init__(**kwargs)
        slots = tuple(slots)
        unknown = [s for s in slots if s not in spec.ALL_SLOTS]
        if not slots or unknown:
            raise ValueError(f"`slots` must be a non-empty subset of {spec.ALL_SLOTS}. "
                             f"Received: slots={slots}")
        if not (dynamic_projection or dynamic_gating):
            raise ValueError("At least one of `dynamic_projection` and `dynamic_gating` must "
                             "be True. Received: dynamic_projection=False, dynamic_gating=False")
        self._cfg = spec.Config(num_heads=num_heads, key_dim=1, num_groups=num_groups,
                                rank=rank, dynamic_hidden_dim=dynamic_hidden_dim).validate()
        self.slots = slots
        self.num_heads = num_heads
        self.num_groups = num_groups
        self.rank = rank
        self.dynamic_hidden_dim = dynamic_hidden_dim
        self.dynamic_projection = bool(dynamic_projection)
        self.dynamic_gating = bool(dynamic_gating)
        self.gelu_approximate = bool(gelu_approximate)
        self.seed = seed

    def build(self, input_shape):
        D = input_shape[-1]
        if D is None:
            raise ValueError("The last dimension of the input of DynamicWeightProjection must "
                             f"be defined. Received: input_shape={input_shape}")
        G, M, R, K, C = self._cfg.G, self._cfg.M, self._cfg.R, self._cfg.K, len(self.slots)
        seed = (lambda i: None) if self.seed is None else (lambda i: self.seed + i)
        normal = keras.initializers.RandomNormal
        self.dw1 = self.qkw = self.dd = None
        if self.dynamic_projection:
            self.dw1 = self.add_weight(
                name="dw1", shape=(D, G, C, K), autocast=False,
                initializer=normal(stddev=math.sqrt(2.0 / (D + K)), seed=seed(0)))
            self.qkw = self.add_weight(
                name="qkw", shape=(G, C, K, 2 * R, M), autocast=False,
                initializer=normal(stddev=math.sqrt(1.0 / K) * 2.0 / (M + R) * 0.01,
                                   seed=seed(1)))
        if self.dynamic_gating:
            self.dd = self.add_weight(
                name="dd", shape=(D, G, C * M), autocast=False,
                initializer=normal(stddev=math.sqrt(2.0 / (D + M)) * 0.005, seed=seed(2)))

    def call(self, inputs, slots=None):
        if slots is None or tuple(slots) == self.slots:
            slots, dw1, qkw, dd = self.slots, self.dw1, self.qkw, self.dd
        else:
            slots = tuple(slots)
            idx = [self.slots.index(s) for s in slots]
            dw1 = qkw = dd = None
            if self.dynamic_projection:
                dw1 = ops.take(self.dw1, idx, axis=2)
                qkw = ops.take(self.qkw, idx, axis=1)
            if self.dynamic_gating:
                D, G, CM = self.dd.shape
                dd4 = ops.reshape(self.dd, (D, G, len(self.slots), CM // len(self.slots)))
                dd = ops.reshape(ops.take(dd4, idx, axis=2), (D, G, -1))
        return dops.dynamic_weights(inputs, dw1, qkw, dd, slots=slots, rank=self.rank,
                                    gelu_approximate=self.gelu_approximate)

    def compute_output_spec(self, inputs, slots=None):
        B, L = inputs.shape[0], inputs.shape[1]
        G, M, R = self._cfg.G, self._cfg.M, self._cfg.R
        out = {}
        for s in (self.slots if slots is None else slots):
            out[s] = {}
            if self.dynamic_projection:
                for n in ("w1", "w2"):
                    out[s][n] = keras.KerasTensor((B, L, G, R, M), dtype="float32")
            if self.dynamic_gating:
                out[s]["dd"] = keras.KerasTensor((B, L, G, M), dtype="float32")
        return out

    def get_config(self):
        return {**super().get_config(), "slots": list(self.slots),
                "num_heads": self.num_heads, "num_groups": self.num_groups, "rank": self.rank,
                "dynamic_hidden_dim": self.dynamic_hidden_dim,
                "dynamic_projection": self.dynamic_projection,
                "dynamic_gating": self.dynamic_gating,
                "gelu_approximate": self.gelu_approximate, "seed": self.seed}


@keras.saving.register_keras_serializable(package="dcmha")
class DCMHA(keras.layers.Layer):
    """Dynamically Composable Multi-Head Attention (Xiao et al., ICML 2024).

    Multi-head attention whose heads are mixed, per query/key position pair,
    by input-dependent matrices: once on the scores before the softmax
    (``pre_compose``) and once on the probabilities after it
    (``post_compose``). With every composition switch off it is
    ``keras.layers.MultiHeadAttention`` (without its biases by default).
    The math is ``dcmha.spec.reference``; scores, compositions and softmax run
    in float32 under any dtype policy.

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
        use_bias: biases on the four projections.
        output_shape: output width D_out (int or 1-tuple; default D_q).
        cross_attention: separate dynamic projections for the query input
            (query_*) and the key input (key_*), which may differ in width.
        implementation: the attention core. "ops": plain keras.ops, every
            backend, every option. The fused fast paths, each on one Keras
            backend: "triton" (torch; CUDA tensors, or CPU tensors with
            TRITON_INTERPRET=1 set before Triton is imported), "torch"
            (torch), "pallas" (jax; compiled on a GPU, interpreted
            elsewhere), "jax_cpu" (jax on CPU) and "tf_cpu" (tensorflow on
            CPU, outside XLA clusters), whose composes run in a C kernel
            compiled on first use, "xla" (tensorflow; no decoding offset with
            the causal mask or a window). No fast path does training dropout
            or intermediates. A fast path named here must be able to run the
            call, or the call raises a ValueError saying why. "auto" (the
            default) takes, per call, the first fast path of the active
            backend that can run the call and is preferred for it, else
            "ops" (then choosing a query chunk size for speed when
            ``query_chunk_size`` is None): on torch "triton" for CUDA
            tensors with Triton installed, then "torch" when its rule
            prefers it; on jax "pallas" on a GPU with a static query offset,
            then "jax_cpu" on CPU for T * S >= 8192; on tensorflow "tf_cpu"
            on CPU for T * S >= 8192 (eager or in a ``tf.function``), then
            "xla" inside a traced ``tf.function`` (eager calls take "ops": a
            per-shape XLA compile costs more than one call saves). See
            ``dcmha.ops.select_implementation``.
        kernel_initializer, bias_initializer: for the four projections.
        seed: int or None; seeds dropout and the initializers.

    Call arguments:
        query: (B, T, D_q).
        value: (B, S, D_kv).
        key: optional (B, S, D_kv); defaults to ``value``.
        attention_mask: boolean (or integer, nonzero = attend), broadcastable
            to (B, T, S), a head axis of size 1 allowed; True = attend. Fully
            masked rows give zero output, never NaN.
        use_causal_mask: keys s <= t only (with a cache: s <= cache_update_index + t).
        return_attention_scores: also return the post-composed, masked
            attention probabilities (B, N, T, S) (float32).
        training: dropout on (True) or off.
        cache: dict from ``init_cache`` (decoding): keys, values and key-side
            dynamic weights of S_max positions; S is then S_max.
        cache_update_index: where the new keys are written; None reads the
            cache without updating it.

    Returns:
        output (B, T, D_out); with scores ``(output, scores)``; with a cache
        ``(output, cache)`` or ``(output, scores, cache)``.
    """

    def __init__(self, num_heads, key_dim, value_dim=None, num_key_value_heads=None,
                 num_groups=1, rank=2, dynamic_hidden_dim=None, pre_compose=True,
                 post_compose=True, query_wise=True, key_wise=True, dynamic_projection=True,
                 dynamic_gating=True, static_compose=False, gelu_approximate=True,
                 qk_norm=False, rope_max_wavelength=None, sliding_window=None,
                 query_chunk_size=None, dropout=0.0, use_bias=False, output_shape=None,
                 cross_attention=False, implementation="auto",
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", seed=None,
                 **kwargs):
        flags = dict(pre_compose=pre_compose, post_compose=post_compose, query_wise=query_wise,
                     key_wise=key_wise, dynamic_projection=dynamic_projection,
                     dynamic_gating=dynamic_gating, static_compose=static_compose,
                     gelu_approximate=gelu_approximate, qk_norm=qk_norm, use_bias=use_bias,
                     cross_attention=cross_attention)
        for name, v in flags.items():
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"`{name}` must be a boolean. Received: {name}={v!r}")
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
        if output_shape is not None:
            dims = (output_shape,) if isinstance(output_shape, (int, np.integer)) else output_shape
            try:
                dims = tuple(dims)
            except TypeError:
                dims = None
            if (not dims or len(dims) != 1 or isinstance(dims[0], bool)
                    or not isinstance(dims[0], (int, np.integer)) or dims[0] <= 0):
                raise ValueError("`output_shape` must be None, a positive integer or a "
                                 f"1-tuple of one. Received: output_shape={output_shape!r}")
            output_shape = int(dims[0])
        dops.resolve_implementation(implementation)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise ValueError(f"`seed` must be None or an integer. Received: seed={seed!r}")
        super().__init__(**kwargs)
        c = self._cfg
        self.num_heads, self.key_dim, self.value_dim = c.N, c.d, c.d_v
        self.num_key_value_heads, self.num_groups, self.rank = c.N_kv, c.G, c.R
        self.dynamic_hidden_dim = dynamic_hidden_dim
        for name, v in flags.items():
            setattr(self, name, bool(v))
        self.rope_max_wavelength = rope_max_wavelength
        self.sliding_window = sliding_window
        self.query_chunk_size = query_chunk_size
        self.dropout = float(dropout)
        self._output_dim = output_shape
        self.implementation = implementation
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.seed = None if seed is None else int(seed)
        self.seed_generator = (keras.random.SeedGenerator(seed, name="dropout_seed")
                               if self.dropout > 0 else None)
        self._slots = spec.slots(c)
        self._query_slots = spec.side_slots(c, "query")
        self._key_slots = spec.side_slots(c, "key")

    # ------------------------------------------------------------------ build
    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if len(shape) != 3 or shape[-1] is None:
                raise ValueError(f"DCMHA expects `{name}` of shape (B, L, D) with a known D. "
                                 f"Received: {name}_shape={tuple(shape)}")
            if shape[-1] <= 0:
                raise ValueError(f"`{name}` must have a positive last dimension D. "
                                 f"Received: {name}_shape={tuple(shape)}")
        if None not in (value_shape[1], key_shape[1]) and value_shape[1] != key_shape[1]:
            raise ValueError("`key` and `value` must have the same length. Received: "
                             f"value_shape={tuple(value_shape)}, key_shape={tuple(key_shape)}")
        c = self._cfg
        D_q, D_k, D_v = query_shape[-1], key_shape[-1], value_shape[-1]
        if self._slots and not c.cross_attention and D_q != D_k:
            raise ValueError(
                "Self-attention dynamic weights share one projection, so `query` and `key` "
                f"must have the same width. Received: query width {D_q}, key width {D_k}; "
                "use cross_attention=True for separate projections.")
        D_out = self._output_dim or D_q
        self._dims = dict(query=D_q, key=D_k, value=D_v, output=D_out)
        N, N_kv, d, d_v, G, M = c.N, c.N_kv, c.d, c.d_v, c.G, c.M
        seed = (lambda i: None) if self.seed is None else (lambda i: self.seed + 100 + i)

        def kernel(name, shape, i):
            return self.add_weight(name=name, shape=shape,
                                   initializer=_seeded(self.kernel_initializer, seed(i)))

        def bias(name, shape, i):
            return self.add_weight(name=name, shape=shape,
                                   initializer=_seeded(self.bias_initializer, seed(i)))

        self.query_kernel = kernel("query_kernel", (D_q, N, d), 0)
        self.key_kernel = kernel("key_kernel", (D_k, N_kv, d), 1)
        self.value_kernel = kernel("value_kernel", (D_v, N_kv, d_v), 2)
        self.output_kernel = kernel("output_kernel", (N, d_v, D_out), 3)
        if c.use_bias:
            self.query_bias = bias("query_bias", (N, d), 4)
            self.key_bias = bias("key_bias", (N_kv, d), 5)
            self.value_bias = bias("value_bias", (N_kv, d_v), 6)
            self.output_bias = bias("output_bias", (D_out,), 7)
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

        def projection(name, slots, width, i):
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
                self.query_dynamic_projection = projection(
                    "query_dynamic_projection", self._query_slots, D_q, 0)
            if self._key_slots:
                self.key_dynamic_projection = projection(
                    "key_dynamic_projection", self._key_slots, D_k, 1)
        elif self._slots:
            self.dynamic_projection_layer = projection("dynamic_projection", self._slots, D_q, 0)

    # ------------------------------------------------------- canonical names
    def _spec_variables(self):
        """Canonical spec name -> variable."""
        if not self.built:
            return None
        names = ["query_kernel", "key_kernel", "value_kernel", "output_kernel"]
        if self._cfg.use_bias:
            names += ["query_bias", "key_bias", "value_bias", "output_bias"]
        names += [n for n in ("static_pre", "static_post") if getattr(self, n) is not None]
        if self._cfg.qk_norm:
            names += ["query_norm_scale", "key_norm_scale"]
        out = {n: getattr(self, n) for n in names}
        for prefix, layer in (("", self.dynamic_projection_layer),
                              ("query_", self.query_dynamic_projection),
                              ("key_", self.key_dynamic_projection)):
            if layer is not None:
                for n in ("dw1", "qkw", "dd"):
                    if getattr(layer, n) is not None:
                        out[prefix + n] = getattr(layer, n)
        return out

    def spec_weights(self):
        """The weights under the spec's canonical names, as NumPy arrays."""
        if not self.built:
            raise ValueError(f"DCMHA layer '{self.name}' is not built yet: call it on inputs "
                             "or call `build()` first.")
        return {n: np.asarray(keras.ops.convert_to_numpy(v.value))
                for n, v in self._spec_variables().items()}

    def load_spec_weights(self, weights):
        """Set the weights from ``{canonical name: array}`` (all of them, or none).

        An unbuilt layer is built from the kernel shapes. Raises ValueError
        naming unknown or missing names, or a name with its expected and
        received shape; nothing is assigned unless everything is valid.
        """
        if not isinstance(weights, collections.abc.Mapping):
            raise TypeError("`weights` must be a mapping {canonical name: array}. "
                            f"Received: {type(weights).__name__}")
        weights = {n: np.asarray(w) for n, w in weights.items()}
        if not self.built:
            missing = [n for n in ("query_kernel", "key_kernel", "value_kernel")
                       if n not in weights]
            if missing:
                raise ValueError(f"DCMHA layer '{self.name}' is not built and cannot be built "
                                 f"from these weights: missing {missing}.")
            self.build((None, None, weights["query_kernel"].shape[0]),
                       (None, None, weights["value_kernel"].shape[0]),
                       (None, None, weights["key_kernel"].shape[0]))
        variables = self._spec_variables()
        unknown = sorted(set(weights) - set(variables))
        if unknown:
            raise ValueError(f"Unknown weight names for DCMHA layer '{self.name}': {unknown}. "
                             f"Expected names: {sorted(variables)}")
        missing = sorted(set(variables) - set(weights))
        if missing:
            raise ValueError(f"Missing weights for DCMHA layer '{self.name}': {missing}. "
                             f"Expected names: {sorted(variables)}")
        for n in variables:
            if weights[n].dtype.kind not in "fiub":
                raise TypeError(f"Weight {n!r} must be a real-valued array. "
                                f"Received: dtype {weights[n].dtype}")
        for n, v in variables.items():
            if tuple(weights[n].shape) != tuple(v.shape):
                raise ValueError(f"Wrong shape for weight '{n}': expected {tuple(v.shape)}, "
                                 f"received {tuple(weights[n].shape)}.")
        for n, v in variables.items():
            v.assign(weights[n].astype(v.dtype))

    # ------------------------------------------------------------------ cache
    def init_cache(self, batch, max_length, dtype=None):
        """An all-zero decoding cache (``reference.cache_shapes`` layout).

        "key" (B, S_max, N_kv, d) after QK-norm and RoPE, "value"
        (B, S_max, N_kv, d_v) and, per enabled key slot, "<slot>_w1"/"<slot>_w2"
        (B, S_max, G, R, M) and "<slot>_dd" (B, S_max, G, M). dtype defaults to
        the compute dtype (the dtype Keras casts float call arguments to).
        """
        dtype = dtype or self.compute_dtype
        return {n: ops.zeros(s, dtype=dtype)
                for n, s in spec.cache_shapes(self._cfg, batch, max_length).items()}

    def _check_cache(self, cache, batch):
        expected = spec.cache_shapes(self._cfg, 1, 1)
        if not isinstance(cache, dict) or set(cache) != set(expected):
            got = sorted(cache) if isinstance(cache, dict) else type(cache).__name__
            raise ValueError(f"`cache` must be a dict with keys {sorted(expected)} (see "
                             f"`init_cache`). Received: {got}")
        for n, s in expected.items():
            if tuple(cache[n].shape[2:]) != s[2:] or len(cache[n].shape) != len(s):
                raise ValueError(f"`cache[{n!r}]` must have shape (B, S_max) + {s[2:]}. "
                                 f"Received: shape={tuple(cache[n].shape)}")
        names = ["key"] + sorted(n for n in cache if n != "key")
        for n in names:
            if None not in (batch, cache[n].shape[0]) and cache[n].shape[0] != batch:
                raise ValueError(f"`cache` must have the batch size of `query`, {batch}. "
                                 f"Received: cache[{n!r}].shape={tuple(cache[n].shape)}")
        length = cache["key"].shape[1]
        for n in names:
            if None not in (length, cache[n].shape[1]) and cache[n].shape[1] != length:
                raise ValueError("Every `cache` entry must have the length S_max of "
                                 f"cache['key'], {length}. "
                                 f"Received: cache[{n!r}].shape={tuple(cache[n].shape)}")

    # ------------------------------------------------------------------- call
    def _check_inputs(self, query, value, key):
        for name, x in (("query", query), ("value", value), ("key", key)):
            if len(x.shape) != 3:
                raise ValueError(f"`{name}` must have rank 3 (B, L, D). "
                                 f"Received: {name}.shape={tuple(x.shape)}")
            if x.shape[-1] != self._dims[name]:
                raise ValueError(f"`{name}` must have last dimension {self._dims[name]} (the "
                                 f"layer was built for it). Received: {name}.shape="
                                 f"{tuple(x.shape)}")
        if None not in (value.shape[1], key.shape[1]) and value.shape[1] != key.shape[1]:
            raise ValueError("`key` and `value` must have the same length. Received: "
                             f"value.shape={tuple(value.shape)}, key.shape={tuple(key.shape)}")
        if len({x.shape[0] for x in (query, value, key)} - {None}) > 1:
            raise ValueError("`query`, `value` and `key` must have the same batch size. "
                             f"Received: query.shape={tuple(query.shape)}, "
                             f"value.shape={tuple(value.shape)}, key.shape={tuple(key.shape)}")

    @staticmethod
    def _check_flags(**flags):
        for name, v in flags.items():
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"`{name}` must be a boolean. Received: {name}={v!r}")

    @staticmethod
    def _check_index(index, new_length, cache_length):
        """cache_update_index: None, an int >= 0, or an integer scalar tensor."""
        if index is None:
            return
        message = "`cache_update_index` must be None, an integer or an integer scalar tensor."
        if hasattr(index, "shape") and hasattr(index, "dtype"):
            dtype = keras.backend.standardize_dtype(index.dtype)
            if not dtype.startswith(("int", "uint")):
                raise TypeError(f"{message} Received: cache_update_index of dtype {dtype}")
            if tuple(index.shape) != ():
                raise TypeError(f"{message} Received: cache_update_index of shape "
                                f"{tuple(index.shape)}")
            return
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"{message} Received: cache_update_index={index!r}")
        if index < 0:
            raise ValueError("`cache_update_index` must be a non-negative integer. "
                             f"Received: cache_update_index={index}")
        if None not in (new_length, cache_length) and index + new_length > cache_length:
            raise ValueError("`cache_update_index` + the new length must be at most the cache "
                             f"length {cache_length}. Received: cache_update_index={index}, "
                             f"new length {new_length}")

    def _project(self, x, kernel, bias_name):
        # Explicit casts (no-ops inside __call__'s autocast scope) so that
        # compute_intermediates, which bypasses __call__, computes the same.
        cd = self.compute_dtype
        y = ops.einsum("bld,dnh->blnh", ops.cast(x, cd), ops.cast(kernel, cd))
        if self._cfg.use_bias:
            y = y + ops.cast(getattr(self, bias_name), cd)
        return ops.cast(y, "float32")

    def _qk(self, y, scale, positions):
        """QK-norm then RoPE, in float32."""
        if self._cfg.qk_norm:
            y = dops.rms_normalize(y, dops.QK_NORM_EPS, scale)
        if self._cfg.rope_max_wavelength is not None:
            y = dops.rope(y, positions, self._cfg.rope_max_wavelength)
        return y

    def _forward(self, query, value, key=None, attention_mask=None, use_causal_mask=False,
                 training=None, cache=None, cache_update_index=None, scores=False,
                 intermediates=False):
        key = value if key is None else key
        self._check_inputs(query, value, key)
        self._check_flags(use_causal_mask=use_causal_mask)
        if cache is not None:
            self._check_cache(cache, query.shape[0])
            self._check_index(cache_update_index, query.shape[1], cache["key"].shape[1])
        c = self._cfg
        T = ops.shape(query)[1]
        offset = 0 if cache_update_index is None else cache_update_index
        q_pos = ops.arange(T, dtype="int32") + ops.cast(offset, "int32") \
            if c.rope_max_wavelength is not None else None
        qscale = getattr(self, "query_norm_scale", None)
        kscale = getattr(self, "key_norm_scale", None)
        q = self._qk(self._project(query, self.query_kernel, "query_bias"), qscale, q_pos)

        # Dynamic weights: query-side slots read `query`, key-side slots `key`.
        read_only = cache is not None and cache_update_index is None
        if c.cross_attention:
            qdyn = self.query_dynamic_projection(query) if self.query_dynamic_projection else {}
            kdyn = (self.key_dynamic_projection(key)
                    if self.key_dynamic_projection and not read_only else {})
        elif not self._slots:
            qdyn, kdyn = {}, {}
        elif key is query and not read_only:
            dyn = self.dynamic_projection_layer(query)
            qdyn = {s: dyn[s] for s in self._query_slots}
            kdyn = {s: dyn[s] for s in self._key_slots}
        else:
            proj = self.dynamic_projection_layer
            qdyn = proj(query, slots=self._query_slots) if self._query_slots else {}
            kdyn = (proj(key, slots=self._key_slots)
                    if self._key_slots and not read_only else {})

        new_cache = None
        if not read_only:
            S_new = ops.shape(key)[1]
            k_pos = ops.arange(S_new, dtype="int32") + ops.cast(offset, "int32") \
                if c.rope_max_wavelength is not None else None
            k = self._qk(self._project(key, self.key_kernel, "key_bias"), kscale, k_pos)
            v = self._project(value, self.value_kernel, "value_bias")
        if cache is not None:
            new_cache = dict(cache)
            if not read_only:
                def write(name, update):
                    entry = cache[name]
                    start = [0, cache_update_index] + [0] * (len(entry.shape) - 2)
                    new_cache[name] = ops.slice_update(entry, start,
                                                       ops.cast(update, entry.dtype))
                write("key", k)
                write("value", v)
                for slot, ws in kdyn.items():
                    for n, w in ws.items():
                        write(f"{slot}_{n}", w)
            k = ops.cast(new_cache["key"], "float32")
            v = ops.cast(new_cache["value"], "float32")
            kdyn = {s: {n: ops.cast(new_cache[f"{s}_{n}"], "float32")
                        for n in ("w1", "w2", "dd") if f"{s}_{n}" in new_cache}
                    for s in self._key_slots}

        terms = {}
        for stage in ("pre", "post"):
            if getattr(c, stage + "_compose"):
                static = getattr(self, "static_" + stage)
                terms[stage] = dops.stage_terms(stage, qdyn, kdyn, static)
        result = dops.dcmha_attention(
            q, k, v, num_groups=c.G, pre=terms.get("pre"), post=terms.get("post"),
            attention_mask=attention_mask, use_causal_mask=use_causal_mask,
            sliding_window=c.sliding_window, query_offset=offset,
            query_chunk_size=c.query_chunk_size, dropout_rate=self.dropout,
            seed=self.seed_generator, training=bool(training),
            return_attention_scores=scores, return_intermediates=intermediates,
            implementation=self.implementation)
        o, extras = result if (scores or intermediates) else (result, {})
        cd = self.compute_dtype
        y = ops.einsum("btnh,nho->bto", ops.cast(o, cd), ops.cast(self.output_kernel, cd))
        if c.use_bias:
            y = y + ops.cast(self.output_bias, cd)
        if intermediates:
            extras.update(query_dynamic=qdyn, key_dynamic=kdyn, q=q, k=k, v=v)
        return y, extras, new_cache

    def call(self, query, value, key=None, attention_mask=None, use_causal_mask=False,
             return_attention_scores=False, training=None, cache=None,
             cache_update_index=None):
        self._check_flags(return_attention_scores=return_attention_scores)
        y, extras, new_cache = self._forward(
            query, value, key, attention_mask=attention_mask, use_causal_mask=use_causal_mask,
            training=training, cache=cache, cache_update_index=cache_update_index,
            scores=return_attention_scores)
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
        return tuple(query_shape[:-1]) + (self._output_dim or query_shape[-1],)

    def compute_output_spec(self, query, value, key=None, attention_mask=None,
                            use_causal_mask=False, return_attention_scores=False,
                            training=None, cache=None, cache_update_index=None):
        out = (keras.KerasTensor(self.compute_output_shape(query.shape, value.shape),
                                 dtype=self.compute_dtype),)
        if return_attention_scores:
            S = cache["key"].shape[1] if cache is not None else value.shape[1]
            out += (keras.KerasTensor((query.shape[0], self.num_heads, query.shape[1], S),
                                      dtype="float32"),)
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
            "output_shape": self._output_dim, "implementation": self.implementation,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "seed": self.seed,
        }

    @property
    def spec_config(self):
        """The spec's ``reference.Config`` of this layer."""
        return self._cfg
