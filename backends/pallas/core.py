"""The "pallas" fast path of ``dcmha.ops.dcmha_attention`` (Keras JAX backend).

Registered as ``IMPLEMENTATION`` in ``dcmha.backends.pallas`` (entry point
``pallas``), imported by ``dcmha.registry`` on first use. It wraps the fused kernels ``dcmha.backends.pallas.dcmha_attention`` (a custom_vjp:
forward and backward kernels) in the contract of the plain core
``dcmha.ops``: ``attention(call)`` takes the projected heads
q (B, T, N, d), k (B, S, N_kv, d), v (B, S, N_kv, d_v) and the compose terms,
and returns (o (B, T, N, d_v) float32, extras) with extras["attention_scores"]
(B, N, T, S) when asked for, {} otherwise. Gradients flow through both.

Rules:

* Declared (the registration): no dropout in training, no intermediates, no
  per-head masks, no traced ``query_offset`` (e.g. a ``cache_update_index`` inside
  ``jax.jit``: the kernels take the offset as a static int).
* ``unsupported(call)`` (a reason, or None): JAX without Pallas.
* ``"auto"`` takes it (declared: ``auto_devices={"gpu"}`` and no tensor offsets)
  on a GPU, where the kernels compile through Triton, with a static
  ``query_offset`` (a Python int: a concrete array offset would compile new
  kernels for every value, e.g. at every eager decoding step). The tiles then always fit: the kernel rounds each
  block up to a power of two of at least 16 (``tl.dot``'s minimum) and pads
  the sequences and head dims to them. Not on TPU: the kernels lower only
  through Triton, so on a TPU they would run in interpret mode (slow). Not on
  CPU: interpret mode is for tests.

Under a ``keras.distribution`` mesh the kernels run once per shard
(``dcmha.partition.partitioned``: ``jax.shard_map``): the batch over the batch
axis, whole composition groups with their heads over the model axis, so the custom
call needs no collective; a layout that would split a group is refused by
``unsupported`` with the reason, and ``"auto"`` takes the "ops" core.

Named explicitly (``implementation="pallas"``) the kernels run anywhere JAX
runs: interpreted on CPU / TPU, compiled on a GPU.

Conventions checked against ``_attention_ops`` and ``spec/SPEC.md``: the kernel
scales the scores itself (``scale`` = 1 / sqrt(d), the default), so q is passed
unscaled; causal is s <= query_offset + t and the window |query_offset + t - s| < W,
as in the spec; the kernel takes a full (B, T, S) mask, so the broadcastable
mask is broadcast here; fully masked rows give zeros.
"""

from __future__ import annotations


def unsupported(call):
    """Why the Pallas kernels cannot run ``call`` (a str), or None when they can."""
    from dcmha import partition
    from dcmha.backends import pallas as pb

    if not pb.is_available():
        return "needs jax.experimental.pallas, which does not import here"
    return partition.partition_problem(call)


def attention(call):
    """(o, extras) of the fused Pallas kernels for a validated ``AttentionCall``, run
    once per shard of the active ``keras.distribution`` mesh (see the module doc).

    Returns (o (B, T, N, d_v) float32, extras), extras {"attention_scores":
    (B, N, T, S) float32} with ``return_attention_scores``, else {}.
    ``query_chunk_size`` is ignored: the kernels tile queries and keys themselves.
    """
    from dcmha import partition
    return partition.partitioned(call, _attention)


def _attention(call):
    """(o, extras) of the kernels for one shard's call (the whole call on one device)."""
    import dataclasses

    import jax.numpy as jnp

    from dcmha import ops as dops
    from dcmha.backends import pallas as pb

    q, k, v = (jnp.asarray(x, jnp.float32) for x in (call.q, call.k, call.v))
    mask = dops.standardize_mask(call.attention_mask)
    if mask is not None:
        mask = jnp.broadcast_to(jnp.asarray(mask, bool), (call.B, call.T, call.S))
    # The call is validated once (dcmha.call.describe); the kernels do not check it again.
    offset = int(call.query_offset)
    result = pb.dcmha_attention_call(dataclasses.replace(
        call, q=q, k=k, v=v, attention_mask=mask, query_offset=offset, static_offset=offset))
    return dops.core_result(result, call.return_attention_scores)
