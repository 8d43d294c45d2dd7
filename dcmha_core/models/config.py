"""DCFormer's arguments, declared once: `resolve_config` checks them and derives the sizes
and each block's attention options; `DCFormerLM` and `dcmha.hub.DCFormerBackbone` take its
signature (``init_signature``) and build their blocks from its result; `count_parameters`
counts from it without building anything.
"""

from __future__ import annotations

import inspect

import numpy as np

import keras

from dcmha.call import check_positive_int
from dcmha.checkpoints import official_intermediate_size
from dcmha.layers import DCMHA

__all__ = ["resolve_config", "count_parameters", "default_intermediate_dim",
           "official_intermediate_size", "serialize_arguments", "init_signature",
           "NAMED_ARGUMENTS"]

#: DCMHA arguments that the model owns; everything else in ``**dcmha_options``
#: goes to every attention layer unchanged.
_MODEL_OWNED = ("num_heads", "key_dim", "value_dim", "num_key_value_heads", "num_groups",
                "qk_norm", "rope_max_wavelength", "sliding_window", "output_shape",
                "cross_attention", "attention_axes", "name", "dtype")

_PLACEMENT = ("`dcmha_layers` must be None, 'all', a positive integer k (every k-th layer) "
              "or a list of layer indices")


def default_intermediate_dim(hidden_dim: int) -> int:
    """`intermediate_dim` when None: the official rule (multiple of 256) for
    hidden_dim >= 512; below that a multiple of 32, so that a tiny model is not
    padded to several times the intended 8/3 * hidden_dim width."""
    return official_intermediate_size(hidden_dim, 256 if hidden_dim >= 512 else 32)


def serialize_arguments(arguments):
    """``arguments`` ({name: value}) for a ``get_config``: plain values as they are, Keras
    objects (initializers, ...) serialised."""
    return {k: v if isinstance(v, (str, int, float, bool, type(None), list, tuple, dict))
            else keras.saving.serialize_keras_object(v) for k, v in arguments.items()}


#: DCMHA's default ``composition_lr_scale``, which a DCFormer model stores even when not given.
_COMPOSITION_LR_SCALE = inspect.signature(DCMHA.__init__).parameters[
    "composition_lr_scale"].default


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def dcmha_placement(dcmha_layers, num_layers):
    """The indices of the layers whose attention is DCMHA, as a tuple, and
    ``dcmha_layers`` as it is stored (None, "all", an int or a sorted list of ints).

    None or "all": every layer. An int k: every k-th layer, i.e. layers k - 1,
    2k - 1, 3k - 1, ... (k = 2 of 4 layers: 1 and 3; k = 4 of 8: 3 and 7). A list or
    tuple: those layer indices, each in [0, num_layers) and none twice.
    """
    if dcmha_layers is None or (isinstance(dcmha_layers, str) and dcmha_layers == "all"):
        return tuple(range(num_layers)), dcmha_layers
    if isinstance(dcmha_layers, str):
        raise ValueError(f"{_PLACEMENT}. Received: dcmha_layers={dcmha_layers!r}")
    if _is_int(dcmha_layers):
        k = int(dcmha_layers)
        if k < 1:
            raise ValueError(f"{_PLACEMENT}. Received: dcmha_layers={dcmha_layers!r}")
        if k > num_layers:
            raise ValueError(f"`dcmha_layers`={k} (every {k}-th layer) places DCMHA in none of "
                             f"the {num_layers} layers; use attention='mha' for none. "
                             f"Received: dcmha_layers={dcmha_layers!r}, num_layers={num_layers}")
        return tuple(range(k - 1, num_layers, k)), k
    if not isinstance(dcmha_layers, (list, tuple)):
        raise TypeError(f"{_PLACEMENT}. Received: dcmha_layers={dcmha_layers!r} of type "
                        f"{type(dcmha_layers).__name__}")
    bad = [i for i in dcmha_layers if not _is_int(i)]
    if bad:
        raise TypeError(f"`dcmha_layers` must list layer indices (integers). Received: "
                        f"dcmha_layers={dcmha_layers!r}")
    if not dcmha_layers:
        raise ValueError("`dcmha_layers` lists no layer; use attention='mha' for none. "
                         f"Received: dcmha_layers={dcmha_layers!r}")
    outside = [int(i) for i in dcmha_layers if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"`dcmha_layers` must be layer indices in [0, {num_layers}) "
                         f"(num_layers={num_layers}). Received: dcmha_layers={dcmha_layers!r}")
    indices = sorted(int(i) for i in dcmha_layers)
    repeated = sorted({i for i in indices if indices.count(i) > 1})
    if repeated:
        raise ValueError(f"`dcmha_layers` lists layers {repeated} more than once. Received: "
                         f"dcmha_layers={dcmha_layers!r}")
    return tuple(indices), indices


def resolve_config(vocab_size, num_layers, hidden_dim, num_heads, intermediate_dim=None,
                   num_key_value_heads=None, num_groups=1, head_dim=None, sliding_window=None,
                   window_pattern="LG", qk_norm=False, rope_max_wavelength=10000,
                   norm_eps=1e-6, tie_embeddings=False, attention="dcmha",
                   kernel_initializer="glorot_uniform", dcmha_layers=None, **dcmha_options):
    """Validate DCFormer's arguments (the one declaration of them: `DCFormerLM` and
    `dcmha.hub.DCFormerBackbone` take this signature); return the derived sizes and
    the per-layer DCMHA options: {"vocab_size", "num_layers", "hidden_dim",
    "num_heads", "head_dim", "intermediate_dim", "tie_embeddings", "dcmha_layers",
    "layer_options", "arguments"}, where ``dcmha_layers`` is the tuple of layer
    indices whose attention composes, ``layer_options(i)`` the ``attention_options``
    of block i (``decoder_blocks``) and ``arguments`` every argument by name
    (defaults filled in, the DCMHA options flat) as the models store and
    serialise them. The arguments are documented on `DCFormerLM`."""
    # The parameters, before anything else is bound: every argument by name.
    arguments = {k: v for k, v in locals().items() if k != "dcmha_options"}
    arguments.update(dcmha_options)
    # Always stored, so that a configuration saved before the parametrisation existed (no
    # such key) is told apart: `from_config` reads it as 1.0 (see `saved_arguments`).
    arguments.setdefault("composition_lr_scale", _COMPOSITION_LR_SCALE)
    for name, value in (("vocab_size", vocab_size), ("num_layers", num_layers),
                        ("hidden_dim", hidden_dim), ("num_heads", num_heads),
                        ("num_groups", num_groups)):
        check_positive_int(name, value)
    for name, value in (("intermediate_dim", intermediate_dim), ("head_dim", head_dim),
                        ("num_key_value_heads", num_key_value_heads),
                        ("sliding_window", sliding_window)):
        check_positive_int(name, value, allow_none=True)
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
    composing, dcmha_layers = dcmha_placement(dcmha_layers, num_layers)
    if attention == "mha" and dcmha_layers not in (None, "all"):
        raise ValueError("attention='mha' switches composition off in every layer; it cannot "
                         f"be combined with `dcmha_layers`. Received: dcmha_layers="
                         f"{dcmha_layers!r}")
    options = dict(dcmha_options)
    if attention == "mha":
        on = [k for k in ("pre_compose", "post_compose") if options.get(k)]
        if on:
            raise ValueError(f"attention='mha' switches composition off; it cannot be "
                             f"combined with {on}=True.")
        options.update(pre_compose=False, post_compose=False)
        composing = ()
    d = head_dim or hidden_dim // num_heads
    intermediate = intermediate_dim or default_intermediate_dim(hidden_dim)

    def layer_options(i):
        local = sliding_window is not None and window_pattern[i % len(window_pattern)] == "L"
        out = dict(options, num_groups=num_groups, qk_norm=bool(qk_norm),
                   rope_max_wavelength=rope_max_wavelength,
                   sliding_window=sliding_window if local else None)
        if i not in composing:
            # Plain multi-head attention, exactly as attention="mha" builds it.
            out.update(pre_compose=False, post_compose=False)
        if options.get("seed") is not None:
            # One seed per layer: equal seeds would give every layer equal weights.
            out["seed"] = int(options["seed"]) + 1000 * i
        if num_key_value_heads is not None:
            out["num_key_value_heads"] = num_key_value_heads
        return out

    arguments.update(vocab_size=int(vocab_size), num_layers=int(num_layers),
                     hidden_dim=int(hidden_dim), num_heads=int(num_heads),
                     qk_norm=bool(qk_norm), norm_eps=float(norm_eps),
                     tie_embeddings=bool(tie_embeddings), dcmha_layers=dcmha_layers)
    return dict(vocab_size=int(vocab_size), num_layers=int(num_layers),
                hidden_dim=int(hidden_dim), num_heads=int(num_heads), head_dim=int(d),
                intermediate_dim=int(intermediate), tie_embeddings=bool(tie_embeddings),
                dcmha_layers=composing, layer_options=layer_options, arguments=arguments)


def saved_arguments(config):
    """A saved DCFormer configuration as the models' ``from_config`` reads it: its DCMHA
    options as ``DCMHA.from_config`` reads them (``DCMHA.saved_config``)."""
    return DCMHA.saved_config(config)


#: `resolve_config`'s named arguments (all but the DCMHA options), in order.
NAMED_ARGUMENTS = tuple(list(inspect.signature(resolve_config).parameters)[:-1])


def init_signature(**keyword_only):
    """The signature of an ``__init__(self, *args, **kwargs)`` that hands its arguments
    to `resolve_config`, as `inspect`, `help` and Keras should see it: ``self``, then
    `resolve_config`'s parameters, with ``keyword_only`` (name=default) before the
    DCMHA options."""
    params = list(inspect.signature(resolve_config).parameters.values())
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v)
             for k, v in keyword_only.items()]
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([self, *params[:-1], *extra, params[-1]])


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
