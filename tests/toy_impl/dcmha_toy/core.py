"""The toy implementation's attention: the validated call on dcmha's plain core."""

from dcmha import ops


def attention(call):
    """(o (B, T, N, d_v) float32, extras) for a validated ``dcmha.call.AttentionCall``."""
    return ops.attention(call)
