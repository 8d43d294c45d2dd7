"""DCMHA's attention core on projected heads and its override point,
``_compute_attention`` (``keras.layers.MultiHeadAttention``'s name and contract)."""

from __future__ import annotations

import dataclasses

from keras import ops

from dcmha import ops as dops
from dcmha.layers.masking import _mask_tensor


@dataclasses.dataclass(frozen=True)
class _CoreCall:
    """What DCMHA's core needs of one call beyond (query, key, value, mask): the
    compose terms of each stage, the query offset (cache_update_index), the causal flag
    left for the core, whether the mask already holds the causal mask and window, and
    whether the intermediates are asked for."""

    terms: dict
    query_offset: object
    use_causal_mask: object
    intermediates: bool
    folded: bool = False


class _CoreMixin:
    """The attention core of ``DCMHA`` (``dcmha.ops.dcmha_attention``) and its override
    point ``_compute_attention``.

    A mixin of ``DCMHA``: it reads the layer's spec config ``_cfg``, static mixes,
    dropout settings, ``implementation`` and the call in progress (``_core_call``).
    """

    def _stage_terms(self, qdyn, kdyn):
        """{stage: compose terms} of the enabled stages, from the dynamic weights of the
        query side ``qdyn`` and the key side ``kdyn`` ({slot: {...}}) and the static mixes."""
        return {stage: dops.stage_terms(stage, qdyn, kdyn, getattr(self, "static_" + stage))
                for stage in ("pre", "post") if getattr(self._cfg, stage + "_compose")}

    def _core_overridden(self):
        """Whether a subclass replaces the core (``_compute_attention``)."""
        return type(self)._compute_attention is not _CoreMixin._compute_attention

    def _attention_core(self, q, k, v, mask, training, scores, context):
        """DCMHA's core (``dcmha.ops.dcmha_attention``) on projected heads: (o (B, T, N,
        d_v) float32, extras) with extras["attention_scores"] (B, N, T, S) when
        ``scores``, and the intermediates when ``context.intermediates``."""
        c = self._cfg
        terms = context.terms
        result = dops.dcmha_attention(
            q, k, v, num_groups=c.G, pre=terms.get("pre"), post=terms.get("post"),
            attention_mask=mask, use_causal_mask=context.use_causal_mask,
            sliding_window=None if context.folded else c.sliding_window,
            query_offset=context.query_offset, query_chunk_size=c.query_chunk_size,
            dropout_rate=self.dropout, seed=self.seed_generator, training=bool(training),
            return_attention_scores=scores, return_intermediates=context.intermediates,
            implementation=self.implementation)
        return result if (scores or context.intermediates) else (result, {})

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
        context = self._core_call
        if context is None:
            context = self._direct_call_context()
            query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
            attention_mask = _mask_tensor(attention_mask)
        if use_causal_mask:
            context = dataclasses.replace(context, use_causal_mask=True)
        o, extras = self._attention_core(query, key, value, attention_mask, training,
                                         bool(return_attention_scores), context)
        return o, extras.get("attention_scores")

    def _direct_call_context(self):
        if self._slots:
            raise ValueError(
                f"`_compute_attention` was called outside `call` on DCMHA layer "
                f"'{self.name}', whose composition needs dynamic weights computed from the "
                "unprojected inputs, which only `call` has. Call the layer, or use "
                "query_wise=False, key_wise=False for a composition of static mixes only.")
        return _CoreCall(terms=self._stage_terms({}, {}), query_offset=0,
                         use_causal_mask=False, intermediates=False)
