"""An attention call run once per shard of the active Keras distribution's device mesh.

The compiled attention paths ("jax_cpu", "pallas") call their kernels through
``partitioned(call, attention)``: under a ``keras.distribution`` mesh (JAX) the call runs
inside ``jax.shard_map``, the batch over the distribution's batch axis and whole
composition groups, with their query and kv heads, over the one other mesh axis, as the
layouts of ``dcmha.distribution`` place them; the kernels then see one device's share and
XLA adds no collective around them. ``partition_problem(call)`` says why a call cannot run
that way (a group would straddle devices); a path's ``unsupported`` returns it, so that
``"auto"`` takes the "ops" core. Without a distribution, on one device, or on a Keras
backend without ``shard_map`` (the seam's ``SHARD_MAP``) the call runs whole.

This module sits below the fast paths (``dcmha.backends``), which import it, and below
``dcmha.distribution``, which re-exports its two functions.
"""

from __future__ import annotations

import dataclasses

import keras

from dcmha import framework
from dcmha.ops import standardize_mask
from dcmha.spec import terms as spec_terms

__all__ = ["partition_problem", "partitioned"]


class _Partition:
    """How one attention call splits over the active Keras distribution's mesh: the batch
    over ``batch`` (None: every device sees the whole batch) and whole composition groups,
    with their query and kv heads, over ``model`` (None: not split), ``size`` devices."""

    def __init__(self, mesh, batch, model, size):
        self.mesh, self.batch, self.model, self.size = mesh, batch, model, size


def _partition(call):
    """(_Partition or None, reason or None) for ``call`` under the active distribution.

    None and None: no distribution, or a mesh of one device (nothing to split). A reason:
    the layout cannot be served per shard (a group would straddle devices, or the mesh has
    several axes besides the batch axis)."""
    if not framework.SHARD_MAP:
        return None, None
    dist = keras.distribution.distribution()
    mesh = getattr(dist, "device_mesh", None)
    if mesh is None:
        return None, None
    sizes = dict(zip(mesh.axis_names, (int(s) for s in mesh.shape)))
    batch = getattr(dist, "batch_dim_name", None)
    others = [a for a, s in sizes.items() if a != batch and s > 1]
    if len(others) > 1:
        return None, (f"the mesh {sizes} has more than one axis besides the batch axis "
                      f"{batch!r}; the kernel runs per shard only with heads over one axis")
    model = others[0] if others else None
    size = sizes[model] if model else 1
    if size > 1 and call.num_groups % size:
        return None, (f"its {call.num_groups} composition groups do not split over the "
                      f"{size} devices of the mesh axis {model!r}: a group would straddle "
                      "devices and every device would compute all groups")
    if batch not in sizes or call.B is None or sizes[batch] == 1 or call.B % sizes[batch]:
        batch = None
    if batch is None and model is None:
        return None, None
    return _Partition(mesh.backend_mesh, batch, model, size), None


def partition_problem(call):
    """None, or why a compiled attention path cannot run ``call`` per shard of the active
    ``keras.distribution`` mesh (its ``unsupported`` rule: ``"auto"`` then passes over it).

    Served: the batch over the distribution's batch axis, whole composition groups (and
    their query and kv heads) over the one other mesh axis of more than one device."""
    return _partition(call)[1]


def partitioned(call, attention):
    """``attention(call)`` -> (o, extras), run once per shard of the active mesh.

    Under a ``keras.distribution`` (JAX) the call's arrays are split as
    ``partition_problem`` describes and ``attention`` runs inside ``jax.shard_map`` on each
    device's share: q (B, T, N, d) and o (B, T, N, d_v) over (batch, -, model, -); k, v
    over (batch, -, model, -), after repeating kv heads to N when the model axis does not
    divide N_kv; compose terms over their B and G axes; the mask over its B axis;
    extras["attention_scores"] (B, N, T, S) over (batch, model). The compiled kernels then
    see local shapes and XLA adds no collective around them. Without a distribution (or on
    one device) this is ``attention(call)``.
    """
    part, reason = _partition(call)
    if reason is not None:
        raise ValueError(f"This attention call cannot run per shard of the device mesh: "
                         f"{reason}.")
    if part is None:
        return attention(call)
    import jax
    from jax.sharding import PartitionSpec

    b, m, P = part.batch, part.model, part.size
    k, v = call.k, call.v
    if P > 1 and call.N_kv % P:           # kv heads the model axis cannot split: repeat them
        rep = call.N // call.N_kv
        k, v = (jax.numpy.repeat(x, rep, axis=2) for x in (k, v))
    axis = {"B": b, "G": m}

    def spec(shape, names):       # B (when not broadcast) over batch, G over model
        return PartitionSpec(*(axis[n] if n == "G" or (n == "B" and size == call.B)
                               else None for n, size in zip(names, shape)))

    def term_specs(terms):
        if not terms:
            return terms
        return {n: spec(x.shape, spec_terms.TERMS[n].shape) for n, x in terms.items()}

    heads = PartitionSpec(b, None, m, None)
    mask = standardize_mask(call.attention_mask)      # (B|1, T|1, S|1)
    mask_spec = None if mask is None else PartitionSpec(
        *([b if mask.shape[0] == call.B else None] + [None] * (len(mask.shape) - 1)))
    extras_spec = ({"attention_scores": PartitionSpec(b, m)}
                   if call.return_attention_scores else {})
    D = 1 if b is None else call.B // part.mesh.shape[b]
    N, N_kv = call.N // P, (call.N if k is not call.k else call.N_kv) // P

    def local(q, k, v, pre, post, mask):
        shard = dataclasses.replace(call, q=q, k=k, v=v, pre=pre, post=post,
                                    attention_mask=mask, num_groups=call.num_groups // P,
                                    B=D if b is not None else call.B, N=N, N_kv=N_kv)
        o, extras = attention(shard)
        return o, dict(extras)

    run = jax.shard_map(local, mesh=part.mesh,
                        in_specs=(heads, heads, heads, term_specs(call.pre),
                                  term_specs(call.post), mask_spec),
                        out_specs=(heads, extras_spec), check_vma=False)
    return run(call.q, k, v, call.pre, call.post, mask)
