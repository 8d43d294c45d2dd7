"""``DCMHA``: Dynamically Composable Multi-Head Attention as one Keras layer.

The layer is built as ``keras.layers.MultiHeadAttention`` is: one class holding its
arguments, ``build``, the forward pass (``call``), the attention core and its override
point ``_compute_attention``, its shapes and config, with module-level helpers for
its arguments, ``attention_axes`` and masks. The math of the core is
``dcmha.ops.dcmha_attention`` (on ``keras.ops``); the decoding cache's layout and
checks are ``dcmha.layers.cache``; the weights by name (canonical spec names,
``from_mha``, 0.1.0 files) are ``dcmha.layers.weights``; the dynamic composition
weights are the ``DynamicWeightProjection`` sublayer (``dcmha.layers.dynamic_weights``).
"""

from __future__ import annotations

import contextvars
import math
import string

import numpy as np

import keras
from keras import ops

from dcmha import allocator, framework
from dcmha import ops as dops
from dcmha import registry
from dcmha.call import shape_of as _shape
from dcmha.call import check_composition_lr_scale, check_positive_int, shapes_agree
from dcmha.layers import cache as cache_lib
from dcmha.layers import weights as weights_lib
from dcmha.layers.dynamic_weights import DynamicWeightProjection
from dcmha.spec import reference as spec
from dcmha.spec import terms as spec_terms

_BOOL_ARGS = ("pre_compose", "post_compose", "query_wise", "key_wise", "dynamic_projection",
              "dynamic_gating", "static_compose", "gelu_approximate", "qk_norm", "use_bias",
              "cross_attention")

#: The call in progress of a layer whose subclass overrides ``_compute_attention``:
#: (layer, compose terms {stage: terms}, query offset). Keras's signature of the
#: override point has no place for the per-call compose terms, so ``call`` hands
#: them to the override's ``super()._compute_attention`` here, for the duration of
#: that one call (a context variable: per thread and task, never on the layer).
_OVERRIDE_CALL = contextvars.ContextVar("dcmha_override_call", default=None)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------

def readable_value(x):
    """``x`` as a NumPy array when its value can be read now, else None.

    None inside ``jax.jit`` (a tracer), a ``tf.function`` (a symbolic tensor),
    ``torch.compile`` / ``torch.export`` / a TorchScript trace (where reading
    would bake the value or break the graph) and for torch "meta" tensors
    (``dcmha.framework.readable_value``).
    """
    return framework.readable_value(x)


def _int_tuple(value, ok):
    """An int or a non-empty iterable of ints, each passing ``ok``, as a tuple; else None."""
    items = (value,) if isinstance(value, (int, np.integer)) else value
    try:
        items = tuple(items)
    except TypeError:
        return None
    if not items or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not ok(n)
                        for n in items):
        return None
    return tuple(int(n) for n in items)


def _product(sizes):
    out = 1
    for n in sizes:
        out = out * n
    return out


def _flash_implementation(flash_attention, implementation, dropout):
    """``implementation`` once MultiHeadAttention's ``flash_attention`` switch is applied.

    None keeps it; True needs a fused core ("auto", which takes one wherever
    the call allows it, or a fast path's name) and, as in MultiHeadAttention,
    no dropout; False is the plain "ops" core.
    """
    registry.resolve(implementation)
    if flash_attention is None:
        return implementation
    if flash_attention:
        if implementation == "ops":
            raise ValueError("`flash_attention=True` asks for a fused attention core, which "
                             "`implementation='ops'` rules out. Received: flash_attention=True, "
                             "implementation='ops'")
        if dropout:
            raise ValueError("Dropout is not supported when flash attention is enabled. "
                             "Please set dropout to 0.0 to use flash attention. "
                             f"Received: dropout={dropout!r}")
        return implementation
    if implementation not in ("auto", "ops"):
        raise ValueError("`flash_attention=False` asks for the plain 'ops' core, which "
                         f"`implementation={implementation!r}` contradicts. Received: "
                         f"flash_attention=False, implementation={implementation!r}")
    return "ops"


def _call_flag(name, value, traced_ok=False):
    """A call flag as a Python bool (bools, ints: non-zero is True, scalar tensors).

    A scalar tensor whose value cannot be read here (traced) is returned as a
    boolean tensor when ``traced_ok``, else refused.
    """
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return bool(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        dtype = keras.backend.standardize_dtype(value.dtype)
        if tuple(value.shape) == () and (dtype == "bool" or dtype.startswith(("int", "uint"))):
            read = readable_value(value)
            if read is not None:
                return bool(read)
            if traced_ok:
                return ops.cast(value, "bool")
            raise ValueError(f"`{name}` decides the structure of the outputs, so its value must "
                             "be known when the layer is called: a Python bool or a concrete "
                             f"scalar tensor. Received: a traced tensor of dtype {dtype}")
        raise ValueError(f"`{name}` must be a boolean or a boolean scalar tensor. Received: "
                         f"{name} of shape {tuple(value.shape)} and dtype {dtype}")
    raise ValueError(f"`{name}` must be a boolean. Received: {name}={value!r}")


def _check_size_argument(name, value, allow_none):
    """``num_heads``, ``key_dim``, ``value_dim``: a positive integer (or None when
    ``allow_none``), refused in MultiHeadAttention's words."""
    try:
        check_positive_int(name, value, allow_none)
    except ValueError:
        expected = "a positive integer or `None`" if allow_none else "a positive integer"
        raise ValueError(f"Received an invalid value for argument `{name}`, expected "
                         f"{expected}. Received: {name}={value!r}") from None


def _check_key_value(value_shape, key_shape, value_text=None, key_text=None,
                     received="{}_shape"):
    """``value`` and ``key`` agree on every axis but the last (static sizes; None:
    unknown), else MultiHeadAttention's ValueError. ``value_text``/``key_text``: the
    shapes as the message shows them (default: the shapes given)."""
    if not shapes_agree(value_shape[1:-1], key_shape[1:-1]):
        raise ValueError("All dimensions of `value` and `key`, except the last one, must be "
                         f"equal. Received: {received.format('value')}="
                         f"{value_text or tuple(value_shape)} and {received.format('key')}="
                         f"{key_text or tuple(key_shape)}")


def _check_fits(shape, expected, message):
    """Raise ValueError(message) unless ``shape`` broadcasts to ``expected`` (static sizes)."""
    if len(shape) > len(expected) or not all(
            a in (1, None) or b is None or a == b for a, b in zip(shape[::-1], expected[::-1])):
        raise ValueError(message)


def _projection_equation(bound, outputs):
    """EinsumDense equation (B', L, *bound) x (*bound, *outputs) -> (B', L, *outputs), bias axes."""
    letters = string.ascii_lowercase
    lead, b = letters[:2], letters[2:2 + bound]
    o = letters[2 + bound:2 + bound + outputs]
    return f"{lead}{b},{b}{o}->{lead}{o}", o


# ---------------------------------------------------------------------------
# attention_axes
# ---------------------------------------------------------------------------

class _AxesLayout:
    """How inputs reach the (B, L, D) attention core when ``attention_axes`` asks for it.

    The axes of the inputs outside ``attention_axes`` (but the batch axis)
    join the batch axis (B' = B x their sizes) and the attention axes are
    flattened into one length, in the order given, so attention over them is
    attention over their flattened product, as in MultiHeadAttention. Outputs
    and scores are unflattened the same way; scores take MultiHeadAttention's
    layout (B, <other axes>, N, <query attention axes>, <key attention axes>).
    Rank-3 inputs attending over axis 1 pass unchanged (``identity``).
    """

    def __init__(self, rank, batch_axes, axes):
        self.rank, self.batch_axes, self.axes = rank, batch_axes, axes
        self.identity = rank == 3
        self.perm = (0,) + batch_axes + axes

    @classmethod
    def create(cls, rank, attention_axes):
        axes = (tuple(range(1, rank - 1)) if attention_axes is None
                else tuple(a + rank if a < 0 else a for a in attention_axes))
        if len(set(axes)) != len(axes) or any(not 1 <= a <= rank - 2 for a in axes):
            raise ValueError("`attention_axes` must name distinct axes of the inputs other than "
                             f"the batch axis and the last axis: for inputs of rank {rank}, "
                             f"axes in [1, {rank - 2}] or [{1 - rank}, -2]. "
                             f"Received: attention_axes={attention_axes!r}")
        return cls(rank, tuple(a for a in range(1, rank - 1) if a not in axes), axes)

    def check_batch_axes(self, query_shape, value_shape):
        if not shapes_agree([query_shape[a] for a in self.batch_axes],
                           [value_shape[a] for a in self.batch_axes]):
            raise ValueError("`query` and `value` must have the same sizes on the axes outside "
                             f"`attention_axes` {self.axes}. Received: query.shape="
                             f"{tuple(query_shape)}, value.shape={tuple(value_shape)}")

    def split(self, shape):
        """(B and the other axes' sizes, the attention axes' sizes) of an input's shape."""
        return ([shape[0]] + [shape[a] for a in self.batch_axes], [shape[a] for a in self.axes])

    def flatten(self, x, features=True):
        """(B, ..., [D]) -> (B', L, [D]); ``features=False`` for a (B, ...) Keras mask."""
        if self.identity:
            return x
        x = ops.transpose(x, self.perm + ((self.rank - 1,) if features else ()))
        shape = ops.shape(x)
        n = len(self.perm)
        return ops.reshape(x, (-1, _product(shape[n - len(self.axes):n])) + tuple(shape[n:]))

    def unflatten_output(self, y, query):
        """(B', T, *out) -> (B, <query axes but the last>, *out)."""
        if self.identity:
            return y
        batch, attn = self.split(ops.shape(query))
        out = tuple(y.shape[2:])
        y = ops.reshape(y, tuple(batch) + tuple(attn) + out)
        back = tuple(int(i) for i in np.argsort(self.perm))
        return ops.transpose(y, back + tuple(range(self.rank - 1, self.rank - 1 + len(out))))

    def scores_shape(self, query_shape, key_shape, num_heads):
        batch, q_attn = self.split(query_shape)
        return tuple(batch) + (num_heads,) + tuple(q_attn) + tuple(self.split(key_shape)[1])

    def unflatten_scores(self, scores, query, key):
        """(B', N, T, S) -> MultiHeadAttention's scores layout."""
        if self.identity:
            return scores
        return ops.reshape(scores, self.scores_shape(ops.shape(query), ops.shape(key),
                                                     scores.shape[1]))

    def flatten_mask(self, mask, query, key, num_heads):
        """An attention mask in the scores layout (smaller ranks expanded at the head
        axis, as MultiHeadAttention does) -> (B', 1 or N, T, S)."""
        target = self.scores_shape(_shape(query), _shape(key), num_heads)
        head = -2 * len(self.axes) - 1
        m = mask
        while len(m.shape) < len(target):
            m = ops.expand_dims(m, head)
        heads = 1 if m.shape[head] == 1 else num_heads
        target_h = target[:head] + (heads,) + target[head + 1:]
        _check_fits(_shape(m), target_h if heads == 1 else target,
                    "`attention_mask` must broadcast to the attention scores' shape "
                    f"(B, <other axes>, N, <query attention axes>, <key attention axes>) = "
                    f"{target}. Received: attention_mask.shape={tuple(mask.shape)}")
        dyn = self.scores_shape(ops.shape(query), ops.shape(key), heads)
        m = ops.broadcast_to(m, dyn)
        n = len(self.axes)
        return ops.reshape(m, (-1, heads, _product(dyn[-2 * n:-n]), _product(dyn[-n:])))


# ---------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------

def _mask_tensor(mask):
    """``attention_mask`` as a boolean tensor, True (non-zero) = attend; lists are converted."""
    if mask is None:
        return None
    if isinstance(mask, (list, tuple)):
        try:
            array = np.asarray(mask)
        except ValueError:                      # ragged nesting
            array = None
        if array is None or array.dtype.kind not in "biuf":
            raise TypeError("`attention_mask` must be a tensor, an array or a nested list of "
                            "booleans or numbers of one shape. Received: a "
                            f"{type(mask).__name__} NumPy cannot read as such"
                            f"{'' if array is None else f' (dtype {array.dtype})'}")
        mask = ops.convert_to_tensor(array)
    elif not (hasattr(mask, "shape") and hasattr(mask, "dtype")):
        raise TypeError("`attention_mask` must be a tensor, an array or a nested list (True / "
                        f"non-zero = attend). Received: {type(mask).__name__}")
    dtype = keras.backend.standardize_dtype(mask.dtype)
    if dtype != "bool" and not dtype.startswith(("int", "uint", "float", "bfloat")):
        raise TypeError("`attention_mask` must be boolean, integer or float (non-zero = attend). "
                        f"Received: attention_mask.dtype={dtype}")
    # MultiHeadAttention's conversion: every non-zero value attends.
    return mask if dtype == "bool" else ops.cast(mask, "bool")


def _combine_masks(layout, num_heads, query, value, key, attention_mask, query_mask,
                   value_mask, key_mask, causal, T, S, offset, has_cache):
    """The boolean mask for the core, and the causal flag left for the core to apply.

    MultiHeadAttention's combination by logical AND: ``attention_mask``, the
    query mask as (B, T, 1), the value and key masks as (B, 1, S), the causal
    mask; in the flattened layout of ``layout`` (``_AxesLayout``). A traced causal
    flag is applied here as a mask. ``query``, ``value``, ``key``: the unflattened
    inputs; T, S: the flattened lengths; ``offset``: the query's position
    (``cache_update_index``); ``has_cache``: a decoding call.
    """
    mask = _mask_tensor(attention_mask)
    parts = []
    if mask is not None:
        parts.append(mask if layout.identity
                     else layout.flatten_mask(mask, query, key, num_heads))
    for name, m, x, axis in (("query_mask", query_mask, query, -1),
                             ("value_mask", value_mask, value, -2),
                             ("key_mask", key_mask, key, -2)):
        if m is None:
            continue
        if axis == -2 and has_cache:
            raise ValueError(f"`{name}` cannot be combined with a `cache`: the keys are the "
                             "cache's S_max positions; pass an `attention_mask` over them.")
        if not hasattr(m, "shape") or not shapes_agree(_shape(m), _shape(x)[:-1]):
            got = f"{name}.shape={tuple(m.shape)}" if hasattr(m, "shape") else type(m).__name__
            name_x = name.split("_")[0]
            raise ValueError(f"`{name}` must have the shape of `{name_x}` without its last "
                             f"axis, {tuple(x.shape)[:-1]}. Received: {got}")
        m = ops.cast(m, "bool")
        parts.append(ops.expand_dims(layout.flatten(m, features=False), axis))
    if not isinstance(causal, bool):
        # The causal mask (1, T, S) from the core's one position rule, where the flag holds.
        visible = dops.block_mask(None, 0, T, 0, S, use_causal_mask=True, sliding_window=None,
                                  query_offset=offset)
        parts.append(ops.logical_or(visible, ops.logical_not(causal)))
        causal = False
    if len(parts) > 1 and mask is not None and layout.identity:
        # Combined below: check the explicit mask here, as the core would.
        B, N = _shape(query)[0], num_heads
        T_, S_ = _shape(query)[1], (S if isinstance(S, int) else None)
        four = len(mask.shape) == 4
        _check_fits(_shape(mask), (B, N, T_, S_) if four else (B, T_, S_),
                    f"`attention_mask` must broadcast to (B, T, S) = {(B, T_, S_)}"
                    f"{f' or (B, N, T, S) = {(B, N, T_, S_)}' if four else ''}. "
                    f"Received: attention_mask.shape={tuple(mask.shape)}")
    if len(parts) <= 1:
        return (parts[0] if parts else None), causal
    rank = 4 if any(len(p.shape) == 4 for p in parts) else 3
    combined = None
    for p in parts:
        while len(p.shape) < 3:
            p = p[None]
        if rank == 4 and len(p.shape) == 3:
            p = p[:, None]
        combined = p if combined is None else ops.logical_and(combined, p)
    return combined, causal


# ---------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------

@keras.saving.register_keras_serializable(package="dcmha")
class DCMHA(keras.layers.Layer):
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
        composition_lr_scale: the step size of the composition weights (dw1, qkw,
            dd) relative to the other weights', under Adam-family optimizers
            (default 0.1, which the quality study supports: benchmarks/RESULTS.md
            "Quality study"). Each of these variables holds its weight divided by
            this scale and the layer multiplies it back, so any such optimizer and
            engine trains them at this fraction of its step, with no wrapper; the
            weights, ``spec_weights()`` and the outputs do not depend on it. 1.0
            switches it off (the variables are the weights, as in ``.keras``
            files saved before it, which load that way); for SGD, whose step
            scales with the gradient, use 1.0 and
            ``dcmha.optimizers.with_composition_learning_rate``. Global-norm
            clipping sees these variables' gradients times the scale
            (docs/differences-from-mha.md).

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
                 kernel_constraint=None, bias_constraint=None, composition_lr_scale=0.1,
                 **kwargs):
        composition_lr_scale = check_composition_lr_scale(composition_lr_scale)
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
        for name, v, allow_none in (("num_heads", num_heads, False), ("key_dim", key_dim, False),
                                    ("value_dim", value_dim, True)):
            _check_size_argument(name, v, allow_none)
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
                raise ValueError("Invalid `output_shape`: it must be None, a positive integer or "
                                 "a tuple of positive integers. "
                                 f"Received: output_shape={output_shape!r}")
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
        self.composition_lr_scale = composition_lr_scale
        self.seed_generator = (keras.random.SeedGenerator(seed, name="dropout_seed")
                               if self.dropout > 0 else None)
        self._slots = spec.slots(c)
        self._query_slots = spec.side_slots(c, "query")
        self._key_slots = spec.side_slots(c, "key")

    # ------------------------------------------------------------------ build
    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        shapes = dict(query=tuple(query_shape), value=tuple(value_shape), key=tuple(key_shape))
        _check_key_value(shapes["value"], shapes["key"])
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
        self._layout = _AxesLayout.create(len(query_shape), self.attention_axes)
        self._layout.check_batch_axes(query_shape, value_shape)
        if framework.device() == "cpu":          # steps reuse their memory (allocator doc)
            allocator.keep_step_memory()
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
                kernel_initializer=weights_lib.fresh_initializer(self.kernel_initializer,
                                                                      seed=seed(i)),
                bias_initializer=weights_lib.fresh_initializer(self.bias_initializer,
                                                                  seed=seed(i + 4)), name=name,
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
                composition_lr_scale=self.composition_lr_scale, dtype=self.dtype_policy,
                name=name)
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

    # MultiHeadAttention's private names for two arguments, read by code written
    # against it (Keras's own tests among it); the arguments themselves are public here.
    _flash_attention = property(lambda self: self.flash_attention)
    _sliding_window = property(lambda self: self.sliding_window)

    # The 0.1.0 attribute names of the projection weights (read-only views).
    query_kernel = property(lambda self: self._query_dense.kernel)
    key_kernel = property(lambda self: self._key_dense.kernel)
    value_kernel = property(lambda self: self._value_dense.kernel)
    output_kernel = property(lambda self: self._output_dense.kernel)
    query_bias = property(lambda self: self._query_dense.bias)
    key_bias = property(lambda self: self._key_dense.bias)
    value_bias = property(lambda self: self._value_dense.bias)
    output_bias = property(lambda self: self._output_dense.bias)

    def _projections(self):
        """{spec prefix: EinsumDense} of the built projections."""
        out = dict(query=self._query_dense, key=self._key_dense, value=self._value_dense,
                   output=self._output_dense)
        if self._gate_dense is not None:
            out["gate"] = self._gate_dense
        return out

    # ------------------------------------------------------------------- call
    def call(self, query, value, key=None, attention_mask=None, use_causal_mask=False,
             return_attention_scores=False, training=None, cache=None,
             cache_update_index=None, query_mask=None, value_mask=None, key_mask=None):
        return_attention_scores = _call_flag("return_attention_scores", return_attention_scores)
        if return_attention_scores and self.flash_attention:
            raise ValueError("Returning attention scores is not supported when flash "
                             "attention is enabled. Please disable flash attention to access "
                             "attention scores.")
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

    # ------------------------------------------------------------ forward pass
    def _check_inputs(self, query, value, key):
        rank = self._layout.rank
        for name, x in (("query", query), ("value", value), ("key", key)):
            if len(x.shape) != rank:
                raise ValueError(f"`{name}` must have rank {rank} "
                                 f"{'(B, L, D)' if rank == 3 else '(B, ..., D)'}. "
                                 f"Received: {name}.shape={tuple(x.shape)}")
            if x.shape[-1] != self._dims[name]:
                raise ValueError(f"`{name}` must have last dimension {self._dims[name]} (the "
                                 f"layer was built for it). Received: {name}.shape="
                                 f"{tuple(x.shape)}")
        # Static sizes only: an exporter's symbolic sizes (torch traced sizes, jax
        # dimension variables) read as None and are not compared.
        _check_key_value(_shape(value), _shape(key), tuple(value.shape), tuple(key.shape),
                         received="{}.shape")
        if len({_shape(x)[0] for x in (query, value, key)} - {None}) > 1:
            raise ValueError("`query`, `value` and `key` must have the same batch size. "
                             f"Received: query.shape={tuple(query.shape)}, "
                             f"value.shape={tuple(value.shape)}, key.shape={tuple(key.shape)}")
        self._layout.check_batch_axes(_shape(query), _shape(value))

    @staticmethod
    def _project(dense, x):
        # The sublayer's own __call__ casts to its compute dtype (also when
        # compute_intermediates bypasses this layer's __call__).
        return ops.cast(dense(x), "float32")

    def _qk(self, y, scale, positions):
        """QK-norm then RoPE, in float32."""
        if self._cfg.qk_norm:
            y = dops.rms_normalize(y, dops.QK_NORM_EPS, scale)
        if self._cfg.rope_max_wavelength is not None:
            y = dops.rope(y, positions, self._cfg.rope_max_wavelength)
        return y

    def _forward(self, query, value, key=None, attention_mask=None, use_causal_mask=False,
                 training=None, cache=None, cache_update_index=None, scores=False,
                 intermediates=False, query_mask=None, value_mask=None, key_mask=None):
        """The forward pass shared by ``call`` and ``compute_intermediates``: input
        checks, projections, dynamic weights, the decoding cache's read and write, the
        masks, then the attention core. Returns (output, extras, new cache or None)."""
        key = value if key is None else key
        self_attention = key is query
        query, value, key, attention_mask, query_mask, value_mask, key_mask, cache = \
            framework.to_layer_device((query, value, key, attention_mask, query_mask, value_mask,
                                  key_mask, cache))
        self._check_inputs(query, value, key)
        causal = _call_flag("use_causal_mask", use_causal_mask, traced_ok=True)
        layout = self._layout
        if cache is not None and not layout.identity:
            raise ValueError("A decoding `cache` needs inputs of rank 3 (B, L, D). Received: "
                             f"query.shape={tuple(query.shape)}")
        if cache is not None:
            cache_lib.check_cache(self._cfg, cache, query.shape[0])
        out_of_range = write_index = None
        # The slice written is the new keys': index + their length must fit the cache.
        if cache is not None:
            traced, cache_update_index = cache_lib.check_index(
                cache_update_index, key.shape[1], cache["key"].shape[1])
            if traced:
                write_index, out_of_range = cache_lib.guard_index(
                    cache_update_index, ops.shape(key)[1], ops.shape(cache["key"])[1])
        inputs = (query, value, key)
        query, value, key = (layout.flatten(x) for x in inputs)
        if self_attention:                   # one projection of the dynamic weights
            key = query
        c = self._cfg
        T = ops.shape(query)[1]
        if write_index is not None:
            cache_update_index = write_index
        offset = 0 if cache_update_index is None else cache_update_index
        q_pos = dops.arange_int32(0, T) + ops.cast(offset, "int32") \
            if c.rope_max_wavelength is not None else None
        qscale = getattr(self, "query_norm_scale", None)
        kscale = getattr(self, "key_norm_scale", None)
        # Dynamic weights: query-side slots read `query`, key-side slots `key`.
        read_only = cache is not None and cache_update_index is None
        fused = None                     # (projected query, dynamic weights) from one product
        if self_attention and not read_only and self._slots and not c.cross_attention:
            fused = framework.fused_query(self._query_dense, self.dynamic_projection_layer, query)
        q = self._project(self._query_dense, query) if fused is None else fused[0]
        q = self._qk(q, qscale, q_pos)

        def dynamic(projection, x, slots=None):
            # A DynamicWeightProjection's call, through the framework seam.
            return framework.call_sublayer(projection, x, slots=slots)

        if c.cross_attention:
            qdyn = (dynamic(self.query_dynamic_projection, query)
                    if self.query_dynamic_projection else {})
            kdyn = (dynamic(self.key_dynamic_projection, key)
                    if self.key_dynamic_projection and not read_only else {})
        elif not self._slots:
            qdyn, kdyn = {}, {}
        elif self_attention and not read_only:
            dyn = fused[1] if fused is not None else dynamic(self.dynamic_projection_layer,
                                                             query)
            qdyn = {s: dyn[s] for s in self._query_slots}
            kdyn = {s: dyn[s] for s in self._key_slots}
        else:
            proj = self.dynamic_projection_layer
            qdyn = dynamic(proj, query, self._query_slots) if self._query_slots else {}
            kdyn = (dynamic(proj, key, self._key_slots)
                    if self._key_slots and not read_only else {})

        new_cache = None
        if not read_only:
            S_new = ops.shape(key)[1]
            k_pos = dops.arange_int32(0, S_new) + ops.cast(offset, "int32") \
                if c.rope_max_wavelength is not None else None
            k = self._qk(self._project(self._key_dense, key), kscale, k_pos)
            v = self._project(self._value_dense, value)
        if cache is not None:
            new_cache = dict(cache)
            if not read_only:
                writer = dops.cache_writer(cache_update_index, S_new, ops.shape(key)[0])

                def write(name, update):
                    new_cache[name] = writer(cache[name], update)
                write("key", k)
                write("value", v)
                for name, w in spec_terms.pack_key_weights(kdyn, self._key_slots,
                                                           stack=dops.stack).items():
                    write(name, w)
            k = dops.as_dtype(new_cache["key"], "float32")
            v = dops.as_dtype(new_cache["value"], "float32")
            kdyn = spec_terms.unpack_key_weights(
                {n: dops.as_dtype(new_cache[n], "float32") for n in spec_terms.KEY_CACHE
                 if n in new_cache}, self._key_slots, unstack=dops.unstack)

        mask, causal = _combine_masks(
            layout, self.num_heads, *inputs, attention_mask, query_mask, value_mask, key_mask,
            causal, T, ops.shape(k)[1], offset, cache is not None)
        terms = self._stage_terms(qdyn, kdyn)
        if self._core_overridden():
            if intermediates:
                raise ValueError(f"{type(self).__name__} overrides `_compute_attention`, so "
                                 "the intermediates of DCMHA's own core are not computed.")
            # The override sees MultiHeadAttention's contract: one mask holding every
            # constraint (the causal mask and the window folded in).
            mask = dops.block_mask(dops.standardize_mask(mask), 0, T, 0, ops.shape(k)[1],
                                   use_causal_mask=causal, sliding_window=c.sliding_window,
                                   query_offset=offset)
            token = _OVERRIDE_CALL.set((self, terms, offset))
            try:
                o, attention_scores = self._compute_attention(q, k, v, mask, training, scores)
            finally:
                _OVERRIDE_CALL.reset(token)
            extras = {"attention_scores": attention_scores} if scores else {}
        else:
            o, extras = self._attention_core(
                q, k, v, mask, training, scores, terms=terms, query_offset=offset,
                use_causal_mask=causal, intermediates=intermediates)
        o = ops.cast(o, self.compute_dtype)
        if self._gate_dense is not None:
            o = o * self._gate_dense(query)
        y = layout.unflatten_output(self._output_dense(o), inputs[0])
        if "attention_scores" in extras:
            extras["attention_scores"] = layout.unflatten_scores(
                extras["attention_scores"], inputs[0], inputs[2])
        if out_of_range is not None:
            y = ops.where(out_of_range, ops.cast(float("nan"), y.dtype), y)
        if intermediates:
            extras.update(query_dynamic=qdyn, key_dynamic=kdyn, q=q, k=k, v=v)
        return y, extras, new_cache

    # ---------------------------------------------------------- attention core
    def _stage_terms(self, qdyn, kdyn):
        """{stage: compose terms} of the enabled stages, from the dynamic weights of the
        query side ``qdyn`` and the key side ``kdyn`` ({slot: {...}}) and the static mixes."""
        return {stage: dops.stage_terms(stage, qdyn, kdyn, getattr(self, "static_" + stage))
                for stage in ("pre", "post") if getattr(self._cfg, stage + "_compose")}

    def _core_overridden(self):
        """Whether a subclass replaces the core (``_compute_attention``)."""
        return type(self)._compute_attention is not DCMHA._compute_attention

    def _attention_core(self, q, k, v, mask, training, scores, *, terms, query_offset,
                        use_causal_mask, intermediates=False, folded=False):
        """DCMHA's core (``dcmha.ops.dcmha_attention``) on projected heads: (o (B, T, N,
        d_v) float32, extras) with extras["attention_scores"] (B, N, T, S) when
        ``scores``, and the intermediates when ``intermediates``.

        ``terms``: {stage: compose terms}; ``query_offset``: the first query's position
        (``cache_update_index``); ``use_causal_mask``: the causal flag left for the
        core; ``folded``: ``mask`` already holds the causal mask and the window.
        """
        c = self._cfg
        result = dops.dcmha_attention(
            q, k, v, num_groups=self.num_groups, pre=terms.get("pre"), post=terms.get("post"),
            attention_mask=mask, use_causal_mask=use_causal_mask,
            sliding_window=None if folded else c.sliding_window,
            query_offset=query_offset, query_chunk_size=c.query_chunk_size,
            dropout_rate=self.dropout, seed=self.seed_generator, training=bool(training),
            return_attention_scores=scores, return_intermediates=intermediates,
            implementation=self.implementation)
        return result if (scores or intermediates) else (result, {})

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False, use_causal_mask=False):
        """The attention core on projected heads; the override point of
        ``keras.layers.MultiHeadAttention``'s name and contract.

        ``call`` projects the inputs, applies QK-norm and RoPE, reads and writes the
        decoding cache and combines every mask, then calls this method with
        (query, key, value, attention_mask, training, return_attention_scores). A
        subclass that overrides it replaces the core (scores, composition, softmax,
        P.V) and keeps the rest; calling ``super()._compute_attention`` inside the
        override runs DCMHA's own composed core for the same call.

        Args:
            query: (B, T, N, d) float32, after QK-norm and RoPE.
            key: (B, S, N_kv, d) float32 (with a cache: its S_max positions).
            value: (B, S, N_kv, d_v) float32.
            attention_mask: boolean, True = attend: (B|1, T, S), (B|1, N, T, S) for a
                per-head mask, or None. In a call of an overriding subclass it holds
                every constraint (explicit mask, input masks, causal mask with the
                cache offset, sliding window), as in MultiHeadAttention.
            training: dropout on (True) or off.
            return_attention_scores: compute the scores (otherwise the second result
                may be None).
            use_causal_mask: also apply the causal mask here (for direct calls, as
                MultiHeadAttention's method takes it; ``call`` folds it into
                ``attention_mask`` for an override).

        Returns:
            (attention_output (B, T, N, d_v), attention_scores (B, N, T, S) or None).
            With attention_axes over several axes, T and S are the flattened products
            of the query's and the key's attention axes and B holds the other axes.

        Called outside ``call`` (no per-call dynamic weights), it computes the
        composition only when the layer needs no dynamic weights (static mixes or
        no composition), else raises a ValueError.
        """
        current = _OVERRIDE_CALL.get()
        if current is not None and current[0] is self:
            # super()._compute_attention inside an override, during `call`: the mask
            # already holds the causal mask and the window.
            _, terms, offset = current
            folded = True
        else:
            if self._slots:
                raise ValueError(
                    f"`_compute_attention` was called outside `call` on DCMHA layer "
                    f"'{self.name}', whose composition needs dynamic weights computed from "
                    "the unprojected inputs, which only `call` has. Call the layer, or use "
                    "query_wise=False, key_wise=False for a composition of static mixes "
                    "only.")
            terms, offset, folded = self._stage_terms({}, {}), 0, False
            query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
            attention_mask = _mask_tensor(attention_mask)
        o, extras = self._attention_core(
            query, key, value, attention_mask, training, bool(return_attention_scores),
            terms=terms, query_offset=offset, use_causal_mask=bool(use_causal_mask),
            folded=folded)
        return o, extras.get("attention_scores")

    # ---------------------------------------------------------- decoding cache
    def init_cache(self, batch, max_length, dtype=None):
        """An all-zero decoding cache (``reference.cache_shapes`` layout).

        "key" (B, S_max, N_kv, d) after QK-norm and RoPE, "value"
        (B, S_max, N_kv, d_v) and, with C_k enabled key slots, "key_w"
        (B, S_max, 2 C_k, G, R, M) (w1 then w2 of each slot, pre_key first) and
        "key_dd" (B, S_max, C_k, G, M). dtype defaults to the compute dtype (the
        dtype Keras casts float call arguments to).
        """
        return cache_lib.init_cache(self._cfg, batch, max_length, dtype or self.compute_dtype)

    # ------------------------------------------------------- weights by name
    def enable_lora(self, rank, lora_alpha=None, a_initializer="he_uniform",
                    b_initializer="zeros", projections=("query", "value")):
        """LoRA on the projections (``EinsumDense.enable_lora`` on each).

        ``projections`` names the sublayers: any of "query", "key", "value",
        "attention_output", "gate" (default: query and value, the common
        choice for attention). Their kernels become non-trainable; the
        composition weights stay trainable.
        """
        if not self.built:
            raise ValueError(f"DCMHA layer '{self.name}' is not built yet: call it on inputs "
                             "or call `build()` first, then `enable_lora()`.")
        by_name = {layer.name: layer for layer in self._projections().values()}
        names = (projections,) if isinstance(projections, str) else tuple(projections)
        unknown = [n for n in names if n not in by_name]
        if not names or unknown:
            raise ValueError(f"`projections` must name sublayers among {sorted(by_name)}. "
                             f"Received: projections={projections!r}")
        for n in names:
            by_name[n].enable_lora(rank, lora_alpha=lora_alpha, a_initializer=a_initializer,
                                   b_initializer=b_initializer)

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantize the projections (``EinsumDense.quantize``); the composition stays float32."""
        for layer in self._projections().values():
            layer.quantize(mode, type_check=type_check, config=config)
        self._is_quantized = True

    def _spec_variables(self):
        """Canonical spec name -> variable (None before ``build``)."""
        if not self.built:
            return None
        return weights_lib.canonical_variables(
            self._projections(), use_bias=self._cfg.use_bias,
            static_mixes=dict(static_pre=self.static_pre, static_post=self.static_post),
            norm_scales=(dict(query_norm_scale=self.query_norm_scale,
                              key_norm_scale=self.key_norm_scale) if self._cfg.qk_norm else {}),
            dynamic={"": self.dynamic_projection_layer,
                     "query_": self.query_dynamic_projection,
                     "key_": self.key_dynamic_projection})

    def spec_weights(self):
        """The weights under the spec's canonical names, as NumPy arrays.

        Projection kernels are the ones the layer computes with (LoRA merged).
        """
        if not self.built:
            raise ValueError(f"DCMHA layer '{self.name}' is not built yet: call it on inputs "
                             "or call `build()` first.")
        weights_lib.check_float_projections(self.name, self._projections().values(),
                                            "spec_weights()")
        values = {n: v.value for n, v in self._spec_variables().items()}
        values.update({f"{n}_kernel": layer.kernel for n, layer in self._projections().items()})
        out = {n: np.asarray(keras.ops.convert_to_numpy(v)) for n, v in values.items()}
        return weights_lib.composition_weights(out, self.composition_lr_scale)

    def load_spec_weights(self, weights):
        """Set the weights from ``{canonical name: array}`` (all of them, or none).

        An unbuilt layer is built from the kernel shapes. Raises ValueError
        naming unknown or missing names, or a name with its expected and
        received shape; nothing is assigned unless everything is valid. With
        LoRA enabled the given kernels become the frozen ones and the LoRA
        update restarts from zero (``lora_kernel_b`` = 0).
        """
        weights = weights_lib.as_arrays(weights)
        if not self.built:
            missing = [n for n in ("query_kernel", "key_kernel", "value_kernel")
                       if n not in weights]
            if missing:
                raise ValueError(f"DCMHA layer '{self.name}' is not built and cannot be built "
                                 f"from these weights: missing {missing}.")
            self.build((None, None, weights["query_kernel"].shape[0]),
                       (None, None, weights["value_kernel"].shape[0]),
                       (None, None, weights["key_kernel"].shape[0]))
        weights_lib.check_float_projections(self.name, self._projections().values(),
                                            "load_spec_weights()")
        variables = self._spec_variables()
        weights = weights_lib.checked_spec_weights(self.name, weights, variables)
        weights = weights_lib.composition_weights(weights, self.composition_lr_scale,
                                                 divide=True)
        for n, v in variables.items():
            v.assign(weights[n].astype(v.dtype))
        for layer in self._projections().values():
            if layer.lora_enabled:
                layer.lora_kernel_b.assign(ops.zeros(layer.lora_kernel_b.shape))

    @classmethod
    def from_mha(cls, mha, **compose_options):
        """A DCMHA with the weights of a built ``keras.layers.MultiHeadAttention``.

        The attention arguments (heads, sizes, biases, gate, output shape,
        attention axes, initializers, regularizers, dtype policy, ...) come
        from ``mha.get_config()``; ``compose_options`` are the composition
        arguments (``num_groups``, ``rank``, ``static_compose``, ...; the
        composition is on by default) and ``name``. The composition starts at
        exactly the identity, so the new layer's output equals the MHA's
        until it is trained (the paper's route for adapting a pretrained
        Transformer): the ``w2`` half of ``qkw``, ``dd`` and the static mixes
        are zero, while the ``w1`` half of ``qkw`` and ``dw1`` keep their
        random initialisation. As with LoRA's zero B, the first step moves
        ``w2``, ``dd`` and the static mixes; ``w1`` and ``dw1`` follow.
        """
        config, theirs = weights_lib.mha_projections(mha, compose_options)
        layer = cls(**{**config, **compose_options})
        layer.build(**mha.get_build_config()["shapes_dict"])
        for n, dense in layer._projections().items():
            dense._kernel.assign(ops.cast(theirs[n].kernel, dense._kernel.dtype))
            if dense.bias is not None:
                dense.bias.assign(theirs[n].bias)
        weights_lib.reset_composition(
            (layer.dynamic_projection_layer, layer.query_dynamic_projection,
             layer.key_dynamic_projection), (layer.static_pre, layer.static_post))
        return layer

    def load_own_variables(self, store):
        """Load this layer's variables; also reads the 0.1.0 layout (``.keras``, ``.weights.h5``)."""
        legacy = []
        if self.built and not self.use_gate:        # 0.1.0 had no gate
            legacy = weights_lib.legacy_variables(
                [self._query_dense, self._key_dense, self._value_dense, self._output_dense],
                use_bias=self._cfg.use_bias, static_mixes=(self.static_pre, self.static_post),
                norm_scales=((self.query_norm_scale, self.key_norm_scale)
                             if self._cfg.qk_norm else ()))
        own = self._trainable_variables + self._non_trainable_variables
        if len(legacy) > len(own) and weights_lib.load_legacy(
                store, legacy, self._projections().values()):
            return
        super().load_own_variables(store)

    # ---------------------------------------------------------------- shapes
    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        _check_key_value(tuple(value_shape),
                         tuple(value_shape if key_shape is None else key_shape))
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
            "composition_lr_scale": self.composition_lr_scale,
        }

    @staticmethod
    def saved_config(config):
        """A saved configuration (of this layer, or of a model passing DCMHA options on) as
        it loads: without ``composition_lr_scale`` (saved before it existed) it is 1.0, the
        composition variables being the weights themselves."""
        return {"composition_lr_scale": 1.0, **config}

    @classmethod
    def from_config(cls, config):
        return super().from_config(cls.saved_config(config))

    @property
    def spec_config(self):
        """The spec's ``reference.Config`` of this layer."""
        return self._cfg
