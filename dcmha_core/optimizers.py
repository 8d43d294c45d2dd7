"""A smaller learning rate for DCMHA's composition weights.

DCMHA's dynamic projection (``dw1``, ``qkw``, ``dd``) starts close to plain attention:
``qkw`` and ``dd`` are initialised at about 1e-3 (the official code's scales). Adam-family
optimizers move every element by about the learning rate per step whatever its size, so
at 3e-3 to 6e-3 these weights leave their start within a few steps. In the quality study
(benchmarks/quality.py, benchmarks/RESULTS.md "Quality study") DCMHA models then lose to
the same model without composition at the higher learning rates that suit it, and giving
the composition weights a tenth of the learning rate removes that loss.

``DCMHA`` (and ``DCFormerLM``) give them that step with any optimizer, with no wrapper: by
default (``composition_lr_scale=0.1``) each of these variables holds its weight divided by
0.1 and the layer multiplies it back, so an Adam-family step, about the learning rate in
size whatever the gradient, moves the weight by a tenth of it. This module is the other
route, for layers built with ``composition_lr_scale=1.0`` (the variables are the weights;
``.keras`` files saved before the parametrisation load that way) and for optimizers
whose step scales with the gradient (SGD), where the parametrisation would scale the
weight's step by the square of the scale:

    optimizer = dcmha.optimizers.with_composition_learning_rate(
        keras.optimizers.AdamW(3e-3, weight_decay=0.01), scale=0.1)
    model.compile(optimizer=optimizer, loss=...)

The scaled optimizer is a subclass of the given one's class, registered with Keras (as
``dcmha>CompositionScaled<Name>``), so a compiled model saves and loads with it once
``dcmha`` is imported. Weight decay is applied with the unscaled learning rate (as the
parametrisation's decay is). The wrapper refuses variables their layer already scales.
"""

from __future__ import annotations

import keras

from dcmha.call import check_composition_lr_scale
# The variable names (the last part of ``Variable.path``) the scale applies to.
from dcmha.layers.weights import COMPOSITION_WEIGHTS

_CLASSES = {}


def is_composition_weight(variable) -> bool:
    """Whether ``variable`` is one of DCMHA's composition weights (dw1, qkw, dd)."""
    return variable.path.split("/")[-1] in COMPOSITION_WEIGHTS


def composition_scaled_class(base):
    """The subclass of the optimizer class ``base`` whose steps on the composition weights
    use ``composition_lr_scale`` times the learning rate (made and registered once)."""
    if not (isinstance(base, type) and issubclass(base, keras.optimizers.Optimizer)):
        raise TypeError("`base` must be a keras.optimizers.Optimizer subclass. Received: "
                        f"base={base!r}")
    if getattr(base, "_dcmha_composition_scaled", False):
        return base
    if base in _CLASSES:
        return _CLASSES[base]

    class CompositionScaled(base):
        """``base`` with ``composition_lr_scale`` x its learning rate on dw1, qkw, dd."""

        _dcmha_composition_scaled = True

        def __init__(self, *args, composition_lr_scale=0.1, **kwargs):
            super().__init__(*args, **kwargs)
            self.composition_lr_scale = check_composition_lr_scale(composition_lr_scale)

        def build(self, variables):
            scaled = [v.path for v in variables if is_composition_weight(v)
                      and getattr(v, "_dcmha_composition_lr_scale", 1.0) != 1.0]
            if scaled:
                raise ValueError(
                    "with_composition_learning_rate scales the composition weights' steps, "
                    "and these are already scaled by their layer's parametrisation "
                    f"(DCMHA's `composition_lr_scale`, 0.1 by default): {scaled[:3]}"
                    f"{' ...' if len(scaled) > 3 else ''}. Train them with the plain "
                    "optimizer, or build the layers with composition_lr_scale=1.0 to use "
                    "this wrapper.")
            super().build(variables)

        def _backend_update_step(self, grads, trainable_variables, learning_rate):
            # Every backend's collective step (torch's fused one and TensorFlow's
            # distributed one included) receives the Keras variables here: one step for
            # the other weights, one for the composition weights at the scaled rate.
            parts = ([], []), ([], [])
            for g, v in zip(grads, trainable_variables):
                part = parts[is_composition_weight(v)]
                part[0].append(g)
                part[1].append(v)
            for (gs, vs), lr in zip(parts, (learning_rate,
                                            learning_rate * self.composition_lr_scale)):
                if vs:
                    super()._backend_update_step(gs, vs, lr)

        def get_config(self):
            config = super().get_config()
            config["composition_lr_scale"] = self.composition_lr_scale
            return config

    name = "CompositionScaled" + base.__name__
    CompositionScaled.__name__ = CompositionScaled.__qualname__ = name
    keras.saving.register_keras_serializable(package="dcmha", name=name)(CompositionScaled)
    _CLASSES[base] = CompositionScaled
    return CompositionScaled


def with_composition_learning_rate(optimizer, scale=0.1):
    """A new optimizer like ``optimizer`` whose steps on DCMHA's composition weights
    (dw1, qkw, dd) use ``scale`` times its learning rate (schedules included).

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` instance (its configuration is copied;
            it is not modified) or a name Keras knows ("adamw", ...).
        scale: positive; 0.1 is what the quality study supports.
    """
    scale = check_composition_lr_scale(scale)
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError("`optimizer` must be a keras.optimizers.Optimizer or its name. "
                        f"Received: optimizer={type(optimizer).__name__}")
    base = type(optimizer)
    if getattr(base, "_dcmha_composition_scaled", False):
        base = base.__bases__[0]              # scaling a scaled optimizer replaces the scale
    config = dict(optimizer.get_config(), composition_lr_scale=scale)
    return composition_scaled_class(base).from_config(config)


# The Keras optimizers users train with, registered at import so that a saved compiled model
# loads with its optimizer.
for _base in (keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.Lion,
              keras.optimizers.SGD, keras.optimizers.RMSprop, keras.optimizers.Adafactor,
              keras.optimizers.Nadam, keras.optimizers.Adamax):
    composition_scaled_class(_base)
del _base
