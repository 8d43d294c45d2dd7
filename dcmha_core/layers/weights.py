"""DCMHA's weights by name: the spec's canonical names, ``from_mha``, LoRA and
quantization of the projections, and the 0.1.0 layout of saved files."""

from __future__ import annotations

import collections.abc

import numpy as np

import keras
from keras import ops


#: The MultiHeadAttention arguments that fix the shapes of its weights:
#: ``DCMHA.from_mha`` takes them from the MultiHeadAttention layer.
_FROM_MHA_FIXED = ("num_heads", "key_dim", "value_dim", "num_key_value_heads", "use_bias",
                   "use_gate", "output_shape", "attention_axes")


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


class _WeightsMixin:
    """The weights of ``DCMHA`` by name: ``spec_weights`` / ``load_spec_weights`` under the
    spec's canonical names, ``from_mha``, ``enable_lora`` and ``quantize`` on the
    projections, and the 0.1.0 attribute names and saved-file layout.

    A mixin of ``DCMHA``: it reads the layer's sublayers (``_projections()``, the dynamic
    projections), its static mixes, QK-norm scales and spec config ``_cfg``.
    """

    # The 0.1.0 attribute names of the projection weights (read-only views).
    query_kernel = property(lambda self: self._query_dense.kernel)
    key_kernel = property(lambda self: self._key_dense.kernel)
    value_kernel = property(lambda self: self._value_dense.kernel)
    output_kernel = property(lambda self: self._output_dense.kernel)
    query_bias = property(lambda self: self._query_dense.bias)
    key_bias = property(lambda self: self._key_dense.bias)
    value_bias = property(lambda self: self._value_dense.bias)
    output_bias = property(lambda self: self._output_dense.bias)

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

    # ------------------------------------------------------- canonical names
    def _check_float_projections(self, what):
        modes = sorted({layer.quantization_mode for layer in self._projections().values()}
                       - {None})
        if modes:
            raise ValueError(f"DCMHA layer '{self.name}' has quantized projections ({modes}); "
                             f"{what} needs their float weights.")

    def _spec_variables(self):
        """Canonical spec name -> variable."""
        if not self.built:
            return None
        dense = self._projections()
        out = {f"{n}_kernel": layer._kernel for n, layer in dense.items()}
        if self._cfg.use_bias:
            out.update({f"{n}_bias": layer.bias for n, layer in dense.items()})
        for n in ("static_pre", "static_post"):
            if getattr(self, n) is not None:
                out[n] = getattr(self, n)
        if self._cfg.qk_norm:
            out.update(query_norm_scale=self.query_norm_scale,
                       key_norm_scale=self.key_norm_scale)
        for prefix, layer in (("", self.dynamic_projection_layer),
                              ("query_", self.query_dynamic_projection),
                              ("key_", self.key_dynamic_projection)):
            if layer is not None:
                for n in ("dw1", "qkw", "dd"):
                    if getattr(layer, n) is not None:
                        out[prefix + n] = getattr(layer, n)
        return out

    def spec_weights(self):
        """The weights under the spec's canonical names, as NumPy arrays.

        Projection kernels are the ones the layer computes with (LoRA merged).
        """
        if not self.built:
            raise ValueError(f"DCMHA layer '{self.name}' is not built yet: call it on inputs "
                             "or call `build()` first.")
        self._check_float_projections("spec_weights()")
        values = {n: v.value for n, v in self._spec_variables().items()}
        values.update({f"{n}_kernel": layer.kernel for n, layer in self._projections().items()})
        return {n: np.asarray(keras.ops.convert_to_numpy(v)) for n, v in values.items()}

    def load_spec_weights(self, weights):
        """Set the weights from ``{canonical name: array}`` (all of them, or none).

        An unbuilt layer is built from the kernel shapes. Raises ValueError
        naming unknown or missing names, or a name with its expected and
        received shape; nothing is assigned unless everything is valid. With
        LoRA enabled the given kernels become the frozen ones and the LoRA
        update restarts from zero (``lora_kernel_b`` = 0).
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
        self._check_float_projections("load_spec_weights()")
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
        for layer in self._projections().values():
            if layer.lora_enabled:
                layer.lora_kernel_b.assign(ops.zeros(layer.lora_kernel_b.shape))

    # ------------------------------------------------ MultiHeadAttention -> DCMHA
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
        if not isinstance(mha, keras.layers.MultiHeadAttention):
            raise TypeError("`mha` must be a keras.layers.MultiHeadAttention layer. "
                            f"Received: {type(mha).__name__}")
        if not mha.built:
            raise ValueError(f"`mha` must be built (call it on inputs first). Received: the "
                             f"unbuilt layer {mha.name!r}")
        fixed = sorted(set(compose_options) & set(_FROM_MHA_FIXED))
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
        layer = cls(**{**config, **compose_options})
        layer.build(**mha.get_build_config()["shapes_dict"])
        for n, dense in layer._projections().items():
            dense._kernel.assign(ops.cast(theirs[n].kernel, dense._kernel.dtype))
            if dense.bias is not None:
                dense.bias.assign(theirs[n].bias)
        layer._reset_composition()
        return layer

    def _reset_composition(self):
        """Make every composition exactly the identity without a dead start (see from_mha)."""
        for proj in (self.dynamic_projection_layer, self.query_dynamic_projection,
                     self.key_dynamic_projection):
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
        for v in (self.static_pre, self.static_post):
            if v is not None:
                v.assign(ops.zeros(v.shape, v.dtype))

    # ------------------------------------------------------- saved files
    def _legacy_variables(self):
        """This layer's variables in the order dcmha 0.1.0 saved them, all its own.

        0.1.0 held the projection kernels and biases itself (query_kernel, ...,
        output_bias) before the static mixes and the QK-norm scales; the
        dynamic projections were sublayers then as now.
        """
        dense = [self._query_dense, self._key_dense, self._value_dense, self._output_dense]
        out = [layer._kernel for layer in dense]
        if self._cfg.use_bias:
            out += [layer.bias for layer in dense]
        out += [v for v in (self.static_pre, self.static_post) if v is not None]
        if self._cfg.qk_norm:
            out += [self.query_norm_scale, self.key_norm_scale]
        return out

    def load_own_variables(self, store):
        """Load this layer's variables; also reads the 0.1.0 layout (``.keras``, ``.weights.h5``)."""
        legacy = self._legacy_variables() if self.built and not self.use_gate else []
        own = self._trainable_variables + self._non_trainable_variables
        # 0.1.0 stored >= 4 more arrays here (the projection kernels), so the
        # count tells the layouts apart.
        if len(legacy) > len(own) and len(store.keys()) == len(legacy):
            for i, v in enumerate(legacy):
                v.assign(store[str(i)])
            for layer in self._projections().values():
                _skip_next_empty_load(layer)
            return
        super().load_own_variables(store)
