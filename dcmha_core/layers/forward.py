"""DCMHA's forward pass: input checks, projections, dynamic weights, the decoding
cache's read and write, then the masks and the attention core."""

from __future__ import annotations

import dataclasses

from keras import ops

from dcmha import backend as seam
from dcmha import ops as dops
from dcmha.call import shape_of as _shape
from dcmha.layers._checks import _call_flag, _same_sizes, arange_int32
from dcmha.layers.core import _CoreCall
from dcmha.spec import terms as spec_terms


class _ForwardMixin:
    """The forward pass of ``DCMHA`` (``_forward``), shared by ``call`` and
    ``compute_intermediates``.

    A mixin of ``DCMHA``: it uses the layer's sublayers and variables (``build``), its
    cache checks (``_CacheMixin``), masks (``_MaskMixin``) and core (``_CoreMixin``).
    """

    # ------------------------------------------------------------------- call
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
        if not _same_sizes(_shape(value)[1:-1], _shape(key)[1:-1]):
            raise ValueError("`key` and `value` must have the same length. Received: "
                             f"value.shape={tuple(value.shape)}, key.shape={tuple(key.shape)}")
        if len({_shape(x)[0] for x in (query, value, key)} - {None}) > 1:
            raise ValueError("`query`, `value` and `key` must have the same batch size. "
                             f"Received: query.shape={tuple(query.shape)}, "
                             f"value.shape={tuple(value.shape)}, key.shape={tuple(key.shape)}")
        self._layout.check_batch_axes(_shape(query), _shape(value))

    @staticmethod
    def _dynamic_weights(projection, x, slots=None):
        """A ``DynamicWeightProjection``'s weights for ``x`` (its call, through the seam)."""
        return seam.call_sublayer(projection, x, slots=slots)

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
        key = value if key is None else key
        self_attention = key is query
        query, value, key, attention_mask, query_mask, value_mask, key_mask, cache = \
            seam.to_layer_device((query, value, key, attention_mask, query_mask, value_mask,
                                  key_mask, cache))
        self._check_inputs(query, value, key)
        causal = _call_flag("use_causal_mask", use_causal_mask, traced_ok=True)
        layout = self._layout
        if cache is not None and not layout.identity:
            raise ValueError("A decoding `cache` needs inputs of rank 3 (B, L, D). Received: "
                             f"query.shape={tuple(query.shape)}")
        if cache is not None:
            self._check_cache(cache, query.shape[0])
        out_of_range = write_index = None
        # The slice written is the new keys': index + their length must fit the cache.
        if cache is not None:
            traced, cache_update_index = self._check_index(
                cache_update_index, key.shape[1], cache["key"].shape[1])
            if traced:
                write_index, out_of_range = self._guard_index(
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
        q_pos = arange_int32(0, T) + ops.cast(offset, "int32") \
            if c.rope_max_wavelength is not None else None
        qscale = getattr(self, "query_norm_scale", None)
        kscale = getattr(self, "key_norm_scale", None)
        # Dynamic weights: query-side slots read `query`, key-side slots `key`.
        read_only = cache is not None and cache_update_index is None
        fused = None                     # (projected query, dynamic weights) from one product
        if self_attention and not read_only and self._slots and not c.cross_attention:
            fused = seam.fused_query(self._query_dense, self.dynamic_projection_layer, query)
        q = self._project(self._query_dense, query) if fused is None else fused[0]
        q = self._qk(q, qscale, q_pos)
        dynamic = self._dynamic_weights
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
            k_pos = arange_int32(0, S_new) + ops.cast(offset, "int32") \
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

        mask, causal = self._attention_mask(
            *inputs, attention_mask, query_mask, value_mask, key_mask, causal, T,
            ops.shape(k)[1], offset, cache is not None)
        context = _CoreCall(terms=self._stage_terms(qdyn, kdyn), query_offset=offset,
                            use_causal_mask=causal, intermediates=intermediates)
        if self._core_overridden():
            if intermediates:
                raise ValueError(f"{type(self).__name__} overrides `_compute_attention`, so "
                                 "the intermediates of DCMHA's own core are not computed.")
            # The override sees MultiHeadAttention's contract: one mask holding every
            # constraint (the causal mask and the window folded in).
            mask = dops.block_mask(dops.standardize_mask(mask), 0, T, 0, ops.shape(k)[1],
                                   use_causal_mask=causal, sliding_window=c.sliding_window,
                                   query_offset=offset)
            context = dataclasses.replace(context, use_causal_mask=False, folded=True)
            self._core_call = context
            try:
                o, attention_scores = self._compute_attention(q, k, v, mask, training, scores)
            finally:
                self._core_call = None
            extras = {"attention_scores": attention_scores} if scores else {}
        else:
            o, extras = self._attention_core(q, k, v, mask, training, scores, context)
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
