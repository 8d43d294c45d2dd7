"""DCMHA's weights by name: the spec's canonical names, the weights of a
``keras.layers.MultiHeadAttention`` (``DCMHA.from_mha``) and the 0.1.0 layout of saved
files, as functions of the variables and sublayers they read."""

from __future__ import annotations

import collections.abc

import numpy as np

import keras
from keras import ops


#: The MultiHeadAttention arguments that fix the shapes of its weights:
#: ``DCMHA.from_mha`` takes them from the MultiHeadAttention layer.
FROM_MHA_FIXED = ("num_heads", "key_dim", "value_dim", "num_key_value_heads", "use_bias",
                  "use_gate", "output_shape", "attention_axes")

def fresh_initializer(initializer, *, offset=0, seed=None):
    """A new instance of ``initializer`` (an instance or anything
    ``keras.initializers.get`` takes) for one more variable: a seeded initializer gets its
    seed + ``offset``, an unseeded one ``seed`` (when given). One seeded initializer used
    for two variables would give them identical values."""
    initializer = keras.initializers.get(initializer)
    config = initializer.get_config()
    if "seed" in config:
        if config["seed"] is not None:
            config["seed"] = int(config["seed"]) + offset
        elif seed is not None:
            config["seed"] = seed
    return initializer.__class__.from_config(config)


#: The weights of each ``DynamicWeightProjection`` (the composition weights), by their
#: canonical names (prefixed "query_" / "key_" with separate sides).
COMPOSITION_WEIGHTS = ("dw1", "qkw", "dd")


def is_composition_name(name) -> bool:
    """Whether the canonical weight name ``name`` is a composition weight's (dw1, qkw, dd,
    of either side)."""
    return name.rsplit("_", 1)[-1] in COMPOSITION_WEIGHTS


def composition_weights(weights, scale, *, divide=False):
    """``weights`` ({canonical name: NumPy array}) with the composition weights (dw1, qkw,
    dd, of any side) multiplied by ``scale`` (divided with ``divide``), in their own
    float dtype: a layer's variables -> its weights under ``composition_lr_scale``
    (``DynamicWeightProjection``), and back."""
    out = dict(weights)
    if scale == 1.0:
        return out
    for n, w in weights.items():
        if is_composition_name(n):
            w = np.asarray(w)
            # Into variables: in float64 (given weights may be float16), rounded once on
            # assignment. Out of them: in the variable's dtype, as the layer multiplies.
            out[n] = (w.astype(np.float64) / scale if divide else
                      w * np.asarray(scale, w.dtype))
    return out


def canonical_variables(projections, *, use_bias, static_mixes, norm_scales, dynamic):
    """{canonical spec name: variable} of a DCMHA layer.

    ``projections``: {spec prefix: EinsumDense} ("query", "key", "value", "output",
    "gate"); ``static_mixes``: {"static_pre"/"static_post": variable or None};
    ``norm_scales``: {"query_norm_scale"/"key_norm_scale": variable} (empty without
    QK-norm); ``dynamic``: {name prefix ("", "query_", "key_"): DynamicWeightProjection
    or None}.
    """
    out = {f"{n}_kernel": layer._kernel for n, layer in projections.items()}
    if use_bias:
        out.update({f"{n}_bias": layer.bias for n, layer in projections.items()})
    out.update({n: v for n, v in static_mixes.items() if v is not None})
    out.update(norm_scales)
    for prefix, layer in dynamic.items():
        if layer is not None:
            out.update({prefix + n: getattr(layer, n) for n in COMPOSITION_WEIGHTS
                        if getattr(layer, n) is not None})
    return out


def check_float_projections(layer_name, projections, what):
    """Raise a ValueError if any projection (EinsumDense) is quantized: ``what`` needs
    their float weights."""
    modes = sorted({layer.quantization_mode for layer in projections} - {None})
    if modes:
        raise ValueError(f"DCMHA layer '{layer_name}' has quantized projections ({modes}); "
                         f"{what} needs their float weights.")


def checked_spec_weights(layer_name, weights, variables):
    """``weights`` ({canonical name: array}) as NumPy arrays once they match ``variables``
    ({canonical name: variable}) in names, dtype kind and shapes, else a ValueError
    (TypeError for the dtype) naming what differs."""
    expected = f"Expected names: {sorted(variables)}"
    unknown = sorted(set(weights) - set(variables))
    if unknown:
        raise ValueError(f"Unknown weight names for DCMHA layer '{layer_name}': {unknown}. "
                         f"{expected}")
    missing = sorted(set(variables) - set(weights))
    if missing:
        raise ValueError(f"Missing weights for DCMHA layer '{layer_name}': {missing}. "
                         f"{expected}")
    for n in variables:
        if weights[n].dtype.kind not in "fiub":
            raise TypeError(f"Weight {n!r} must be a real-valued array. "
                            f"Received: dtype {weights[n].dtype}")
    for n, v in variables.items():
        if tuple(weights[n].shape) != tuple(v.shape):
            raise ValueError(f"Wrong shape for weight '{n}': expected {tuple(v.shape)}, "
                             f"received {tuple(weights[n].shape)}.")
    return weights


def as_arrays(weights):
    """A mapping {canonical name: array-like} as {name: NumPy array}, else a TypeError."""
    if not isinstance(weights, collections.abc.Mapping):
        raise TypeError("`weights` must be a mapping {canonical name: array}. "
                        f"Received: {type(weights).__name__}")
    return {n: np.asarray(w) for n, w in weights.items()}


def mha_projections(mha, compose_options):
    """(config, {spec prefix: EinsumDense}) of a built ``keras.layers.MultiHeadAttention``
    for ``DCMHA.from_mha``, after the checks of ``mha`` and of ``compose_options``."""
    if not isinstance(mha, keras.layers.MultiHeadAttention):
        raise TypeError("`mha` must be a keras.layers.MultiHeadAttention layer. "
                        f"Received: {type(mha).__name__}")
    if not mha.built:
        raise ValueError(f"`mha` must be built (call it on inputs first). Received: the "
                         f"unbuilt layer {mha.name!r}")
    fixed = sorted(set(compose_options) & set(FROM_MHA_FIXED))
    if fixed:
        raise ValueError(f"`from_mha` takes {fixed} from the MultiHeadAttention layer. "
                         f"Received: {', '.join(f'{n}={compose_options[n]!r}' for n in fixed)}")
    theirs = dict(query=mha._query_dense, key=mha._key_dense, value=mha._value_dense,
                  output=mha._output_dense)
    if getattr(mha, "_gate_dense", None) is not None:
        theirs["gate"] = mha._gate_dense
    modes = sorted({layer.quantization_mode for layer in theirs.values()} - {None})
    if modes:
        raise ValueError(f"`mha` has quantized projections ({modes}); from_mha needs float "
                         "weights.")
    config = {k: v for k, v in mha.get_config().items() if k != "name"}
    return config, theirs


def reset_composition(dynamic_projections, static_mixes):
    """Make every composition exactly the identity without a dead start (``from_mha``).

    ``dynamic_projections``: the layer's ``DynamicWeightProjection``s (None skipped);
    ``static_mixes``: its static (G, M, M) variables (None skipped).
    """
    for proj in dynamic_projections:
        if proj is None:
            continue
        if proj.qkw is not None:
            # qkw (G, C, K, 2R, M): rows [:R] give w1, rows [R:] give w2; the
            # low-rank terms are w1 (x) w2, so w2 = 0 zeroes them while w2
            # still gets the gradient w1 . dL/dW (as LoRA's zero B).
            qkw = np.array(keras.ops.convert_to_numpy(proj.qkw.value))
            qkw[:, :, :, proj.rank:, :] = 0.0
            proj.qkw.assign(qkw)
        if proj.dd is not None:
            proj.dd.assign(ops.zeros(proj.dd.shape, proj.dd.dtype))
    for v in static_mixes:
        if v is not None:
            v.assign(ops.zeros(v.shape, v.dtype))


def legacy_variables(dense, *, use_bias, static_mixes, norm_scales):
    """A layer's variables in the order dcmha 0.1.0 saved them, all its own.

    0.1.0 held the projection kernels and biases itself (query_kernel, ...,
    output_bias) before the static mixes and the QK-norm scales; the
    dynamic projections were sublayers then as now. ``dense``: the query, key,
    value and output EinsumDense in that order.
    """
    out = [layer._kernel for layer in dense]
    if use_bias:
        out += [layer.bias for layer in dense]
    out += [v for v in static_mixes if v is not None]
    return out + list(norm_scales)


def load_legacy(store, legacy, projections):
    """Load a 0.1.0 store into ``legacy`` (``legacy_variables``); True if ``store`` has
    that layout, else False (nothing loaded).

    0.1.0 stored >= 4 more arrays in the layer's own store (the projection
    kernels), so the count tells the layouts apart.
    """
    if not legacy or len(store.keys()) != len(legacy):
        return False
    for i, v in enumerate(legacy):
        v.assign(store[str(i)])
    for layer in projections:
        _skip_next_empty_load(layer)
    return True


def _skip_next_empty_load(layer):
    """Let ``layer``'s next ``load_own_variables`` pass over an empty store, once.

    A dcmha 0.1.0 file holds the projection weights in the DCMHA layer's own
    store (its ``load_own_variables`` has assigned them); Keras then visits
    each projection sublayer with a store that such a file does not have.
    """
    def load_once(store):
        del layer.load_own_variables          # back to the class's method
        if len(store.keys()):
            layer.load_own_variables(store)

    layer.load_own_variables = load_once
