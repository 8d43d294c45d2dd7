"""The state shared by the parts of a DCMHA function body (``dcmha_function._Body``)."""

from __future__ import annotations

from typing import Sequence, Tuple

from onnx import TensorProto

from dcmha.export.call_spec import DTYPES, CallSpec
from dcmha.export.emitter import Emitter
from dcmha.spec import reference as ref


class BodyState:
    """What every part of a DCMHA function body reads while it writes: the configuration,
    the call, the dtype, the input widths, the weights' value names and the node emitter
    ``e`` (swapped for a Loop body's own emitter while a query chunk is written).

    ``heads_first`` and ``dyn_type`` are layout choices made once per body (see the comments
    below); ``c`` writes a constant in the compute dtype.
    """

    def __init__(self, cfg: ref.Config, call: CallSpec, dtype: str, widths: Tuple[int, int, int],
                 weights: Sequence[str], compose_nodes: bool = False):
        self.cfg, self.call = cfg, call
        self.compose_nodes = compose_nodes
        self.ft = DTYPES[dtype]
        self.D_q, self.D_kv, self.D_out = widths
        self.e = Emitter()
        self.w = {n: n for n in weights}
        self.dtype = dtype
        # q (B, N, T, d) and k (B, N_kv, S, d) heads first, instead of (B, T, N, d) and
        # (B, S, N_kv, d): a forward self-attention call's RoPE straight from the fused
        # projection's output (``fused_projections``, ``_rope_heads``)
        self.heads_first = bool(compose_nodes and call.self_attention and not call.decode
                                and not cfg.qk_norm and cfg.rope_max_wavelength is not None)
        # the dynamic weights' type (``dynamic``): float32 where only kernel nodes, which
        # take float32, read them (one Cast per kind, not one per slot), else the dtype
        self.dyn_type = TensorProto.FLOAT if compose_nodes and not call.intermediates else self.ft

    def c(self, value, dtype=None):
        """A Constant node holding ``value`` in ``dtype`` (default: the compute dtype)."""
        return self.e.const(value, self.ft if dtype is None else dtype)
