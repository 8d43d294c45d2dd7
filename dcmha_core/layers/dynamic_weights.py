"""``DynamicWeightProjection``: the sublayer computing DCMHA's dynamic composition weights."""

from __future__ import annotations

import math

import keras
from keras import ops

from dcmha import framework
from dcmha import ops as dops
from dcmha.call import check_composition_lr_scale
from dcmha.spec import reference as spec


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
        composition_lr_scale: the parametrisation of dw1, qkw and dd: each variable
            holds its weight divided by this scale and the call multiplies it back,
            so that Adam-family optimizers, whose steps have about the learning
            rate's size whatever the gradient's, move the weight by this fraction of
            their step. 1.0: the variables are the weights. The weights (and the
            forward numbers) do not depend on it.

    Call arguments:
        inputs: (B, L, D).
        slots: optional subset of ``slots`` to compute (default: all).

    Returns:
        ``{slot: {"w1": (B, L, G, R, M), "w2": (B, L, G, R, M), "dd": (B, L, G, M)}}``.
    """

    def __init__(self, slots, num_heads, num_groups=1, rank=2, dynamic_hidden_dim=None,
                 dynamic_projection=True, dynamic_gating=True, gelu_approximate=True,
                 seed=None, composition_lr_scale=1.0, **kwargs):
        composition_lr_scale = check_composition_lr_scale(composition_lr_scale)
        super().__init__(**kwargs)
        # Per-position weights: it takes the inputs' Keras masks and passes none on.
        self.supports_masking = True
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
        self.composition_lr_scale = composition_lr_scale

    def build(self, input_shape):
        D = input_shape[-1]
        if D is None:
            raise ValueError("The last dimension of the input of DynamicWeightProjection must "
                             f"be defined. Received: input_shape={input_shape}")
        G, M, R, K, C = self._cfg.G, self._cfg.M, self._cfg.R, self._cfg.K, len(self.slots)
        self._input_dim = D
        seed = (lambda i: None) if self.seed is None else (lambda i: self.seed + i)
        scale = self.composition_lr_scale

        def normal(stddev, i):
            # The variable holds weight / scale: the spec's N(0, stddev) weight.
            return keras.initializers.RandomNormal(stddev=stddev / scale, seed=seed(i))

        def variable(name, shape, initializer):
            v = self.add_weight(name=name, shape=shape, autocast=False,
                                initializer=initializer)
            v._dcmha_composition_lr_scale = scale      # read by dcmha.optimizers
            return v

        self.dw1 = self.qkw = self.dd = None
        if self.dynamic_projection:
            self.dw1 = variable("dw1", (D, G, C, K), normal(math.sqrt(2.0 / (D + K)), 0))
            self.qkw = variable("qkw", (G, C, K, 2 * R, M),
                                normal(math.sqrt(1.0 / K) * 2.0 / (M + R) * 0.01, 1))
        if self.dynamic_gating:
            self.dd = variable("dd", (D, G, C * M), normal(math.sqrt(2.0 / (D + M)) * 0.005, 2))

    def weight(self, name):
        """The weight ``name`` ("dw1", "qkw" or "dd") as the math uses it: its variable
        times ``composition_lr_scale`` (the variable itself at 1.0); None if absent."""
        v = getattr(self, name)
        if v is None or self.composition_lr_scale == 1.0:
            return v
        return framework.scaled_weight(v, self.composition_lr_scale)

    def call(self, inputs, slots=None):
        # The variables, scaled by dynamic_weights (where compiled, on the products).
        dw1, qkw, dd = self.dw1, self.qkw, self.dd
        if slots is None or tuple(slots) == self.slots:
            slots = self.slots
        else:
            slots = tuple(slots)
            idx = [self.slots.index(s) for s in slots]
            if self.dynamic_projection:
                dw1 = ops.take(dw1, idx, axis=2)
                qkw = ops.take(qkw, idx, axis=1)
            if self.dynamic_gating:
                D, G, CM = self.dd.shape
                dd4 = ops.reshape(dd, (D, G, len(self.slots), CM // len(self.slots)))
                dd = ops.reshape(ops.take(dd4, idx, axis=2), (D, G, -1))
        if len(inputs.shape) != 3 or inputs.shape[-1] not in (None, self._input_dim):
            raise ValueError("The input of DynamicWeightProjection must have shape (B, L, D) "
                             f"with D={self._input_dim}. Received: shape={tuple(inputs.shape)}")
        return dops.dynamic_weights(inputs, dw1, qkw, dd, slots=slots, rank=self.rank,
                                    gelu_approximate=self.gelu_approximate, check=False,
                                    weight_scale=self.composition_lr_scale)

    def compute_mask(self, inputs, previous_mask=None):
        # Per-position weights: the DCMHA layer consumes the inputs' Keras masks.
        return None

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
                "gelu_approximate": self.gelu_approximate, "seed": self.seed,
                "composition_lr_scale": self.composition_lr_scale}
