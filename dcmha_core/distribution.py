"""Multi-device layouts for DCMHA layers and DCFormer models (``keras.distribution``).

``layout_map(mesh, target)`` returns a ``keras.distribution.LayoutMap`` that
shards attention heads over the mesh's ``"model"`` axis (tensor parallelism
in the Megatron style) and ``model_parallel(mesh, target)`` wraps it in a
``keras.distribution.ModelParallel`` that also splits the batch over the
``"data"`` axis. Variables are matched by their Keras paths: the projections
are MultiHeadAttention's EinsumDense sublayers (``<layer>/query/kernel``,
``<layer>/attention_output/bias``, ...), the composition weights
``<layer>/dynamic_projection/dw1``, ``<layer>/static_pre``, ...

With P devices on the model axis:

* Heads. The N axis of query_kernel (D_q, N, d), query_bias (N, d),
  output_kernel (N, d_v, D_out) and the gate's kernel and bias (``use_gate``)
  is split into P contiguous blocks when P divides N; key/value kernels
  (D_kv, N_kv, *) and biases when P divides N_kv. Query head n reads kv head n // (N / N_kv), so contiguous blocks of
  query heads read the same-numbered block of kv heads and GQA stays local.
* Composition. Heads are mixed within groups of M = N / G consecutive heads.
  When P divides G, every device holds G / P whole groups: dw1 (D, G, C, K),
  qkw (G, C, K, 2R, M), dd (D, G, C*M) and static_pre/static_post (G, M, M)
  are split along G and composition needs no communication. Otherwise a group
  straddles devices; the dynamic projection and the static weights are then
  replicated (they are small: about 2% of a model's parameters) and XLA
  inserts the exchange of scores that compose needs.
* DCFormerLM. SwiGLU w1/w3 kernels (D, I) are split along I and w2 (I, D)
  along I; the embedding table (V, D) and the output kernel (D, V) along the
  vocabulary. RMSNorm scales and QK-norm scales are replicated. Any axis that
  P does not divide is replicated.

Keras applies a layout when a variable is created, so create (or build) the
model inside ``distribution.scope()`` (or after
``keras.distribution.set_distribution``). Only the JAX backend implements
``keras.distribution``.

Across processes (``keras.distribution.initialize``), ``multi_host_mesh()`` puts
``model`` over each process's own devices and ``data`` across processes, and
``gathered_weights(model)`` reads the sharded weights back whole on every process.

The compiled attention paths ("jax_cpu", "pallas") run once per shard of the active
distribution's mesh (``partitioned``, from ``dcmha.partition``, which the paths import):
the batch over the batch axis and whole groups over the one other axis, as these layouts
place them. With a layout map of one's own that does not split heads over that axis, the
"ops" core may need fewer collectives. ``partition_problem`` says why a call cannot run
that way (its groups would straddle devices); ``"auto"`` then takes "ops".
``docs/distribution.md`` has a recipe per engine.

Example (8 devices: 2-way data parallel x 4-way model parallel)::

    import keras
    from dcmha import distribution as ddist
    from dcmha.models import DCFormerLM

    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"),
                                         keras.distribution.list_devices())
    model = DCFormerLM(vocab_size=50432, num_layers=24, hidden_dim=1024,
                       num_heads=16, num_groups=4)          # not built yet
    with ddist.model_parallel(mesh, model).scope():
        model.build((None, None))
        model.compile(optimizer="adamw", loss=...)
        model.fit(...)
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import keras

from dcmha import framework
from dcmha.call import check_positive_int
from dcmha.partition import partition_problem, partitioned

__all__ = ["layout_map", "model_parallel", "sharding_plan", "multi_host_mesh", "gathered_weights",
           "partition_problem", "partitioned"]

#: Canonical DCMHA variable names and which of their axes holds heads (N or
#: N_kv) or groups (G). None: never sharded.
_DCMHA_AXES = {
    "query_kernel": ("N", 1), "query_bias": ("N", 0), "output_kernel": ("N", 0),
    "gate_kernel": ("N", 1), "gate_bias": ("N", 0),
    "key_kernel": ("N_kv", 1), "value_kernel": ("N_kv", 1),
    "key_bias": ("N_kv", 0), "value_bias": ("N_kv", 0),
    "dw1": ("G", 1), "qkw": ("G", 0), "dd": ("G", 1),
    "static_pre": ("G", 0), "static_post": ("G", 0),
}
_RANKS = {"query_kernel": 3, "key_kernel": 3, "value_kernel": 3, "output_kernel": 3,
          "gate_kernel": 3, "query_bias": 2, "key_bias": 2, "value_bias": 2, "gate_bias": 2,
          "dw1": 4, "qkw": 5, "dd": 3, "static_pre": 3, "static_post": 3}
#: The variable path (below the DCMHA layer) of each canonical name that is not
#: the path itself: the projections are EinsumDense sublayers named as in
#: keras.layers.MultiHeadAttention.
_PATHS = {"query_kernel": "query/kernel", "query_bias": "query/bias",
          "key_kernel": "key/kernel", "key_bias": "key/bias",
          "value_kernel": "value/kernel", "value_bias": "value/bias",
          "gate_kernel": "gate/kernel", "gate_bias": "gate/bias",
          "output_kernel": "attention_output/kernel"}


def _attention_sizes(target) -> Dict[Tuple[int, int, int], list]:
    """{(N, N_kv, G): [layer path or None, ...]} of the DCMHA layers of ``target``."""
    from dcmha.layers import DCMHA

    if isinstance(target, DCMHA):
        return {(target.num_heads, target.num_key_value_heads, target.num_groups):
                [target.path if target.built else None]}
    from dcmha.models import DCFormerLM

    if isinstance(target, DCFormerLM):
        N = target.num_heads
        return {(N, target.num_key_value_heads or N, target.num_groups): [None]}
    if isinstance(target, keras.Model):
        found: Dict[Tuple[int, int, int], list] = {}
        for layer in target._flatten_layers(include_self=False, recursive=True):
            if isinstance(layer, DCMHA):
                found.setdefault((layer.num_heads, layer.num_key_value_heads,
                                  layer.num_groups), []).append(layer.path)
        if not found:
            raise ValueError(f"`target` has no DCMHA layer. Received: target={target.name!r} "
                             f"of class {type(target).__name__}")
        return found
    raise TypeError("`target` must be a dcmha.DCMHA layer, a dcmha.models.DCFormerLM or a "
                    f"keras.Model containing DCMHA layers. Received: {type(target).__name__}")


def sharding_plan(num_heads, num_key_value_heads=None, num_groups=1, model_size=1):
    """Which DCMHA variables are split over a model axis of ``model_size`` devices.

    Returns ``{canonical name: axis index or None}`` (None: replicated), e.g.
    ``{"query_kernel": 1, "dw1": 1, "key_kernel": None, ...}``.
    """
    num_key_value_heads = num_key_value_heads or num_heads
    for name, v in (("num_heads", num_heads), ("num_key_value_heads", num_key_value_heads),
                    ("num_groups", num_groups), ("model_size", model_size)):
        check_positive_int(name, v)
    if num_heads % num_groups:
        raise ValueError("`num_heads` must be divisible by `num_groups`. Received: "
                         f"num_heads={num_heads}, num_groups={num_groups}")
    if num_heads % num_key_value_heads:
        raise ValueError("`num_heads` must be divisible by `num_key_value_heads`. Received: "
                         f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}")
    # G and N_kv divide N, so splitting groups or kv heads implies splitting
    # the query heads into matching contiguous blocks.
    sizes = {"N": num_heads, "N_kv": num_key_value_heads, "G": num_groups}
    split = {k: v % model_size == 0 for k, v in sizes.items()}
    return {name: (axis if split[kind] else None) for name, (kind, axis) in
            _DCMHA_AXES.items()}


def _axes(rank, axis, name):
    out = [None] * rank
    if axis is not None:
        out[axis] = name
    return tuple(out)


def layout_map(mesh, target, *, model_axis: str = "model", data_axis: Optional[str] = "data",
               base=None):
    """A ``keras.distribution.LayoutMap`` for the DCMHA layers (and DCFormerLM) of ``target``.

    Args:
        mesh: a ``keras.distribution.DeviceMesh`` with an axis ``model_axis``.
        target: a ``dcmha.DCMHA`` layer, a ``dcmha.models.DCFormerLM`` (built
            or not), or a built ``keras.Model`` containing DCMHA layers.
        model_axis: mesh axis that heads and composition groups are split over.
        data_axis: mesh axis of the batch (see ``model_parallel``); None when
            the mesh has no data axis. Only checked here.
        base: an existing LayoutMap on the same mesh to add the DCMHA entries
            to (for a model with further layers of its own).

    Returns:
        The LayoutMap. Keys are regular expressions over variable paths;
        variables that match none are replicated.
    """
    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise TypeError("`mesh` must be a keras.distribution.DeviceMesh. "
                        f"Received: {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if model_axis not in names:
        raise ValueError(f"`model_axis` must be an axis of the mesh {names}. "
                         f"Received: model_axis={model_axis!r}")
    if data_axis is not None and data_axis not in names:
        raise ValueError(f"`data_axis` must be None or an axis of the mesh {names}. "
                         f"Received: data_axis={data_axis!r}")
    if data_axis == model_axis:
        raise ValueError(f"`data_axis` and `model_axis` must differ. Received: both "
                         f"{model_axis!r}")
    if base is not None and not isinstance(base, keras.distribution.LayoutMap):
        raise TypeError("`base` must be None or a keras.distribution.LayoutMap. "
                        f"Received: {type(base).__name__}")
    P = int(mesh.shape[names.index(model_axis)])
    lm = base if base is not None else keras.distribution.LayoutMap(mesh)
    groups = _attention_sizes(target)
    # One set of generic patterns when every DCMHA layer has the same sizes;
    # per-layer patterns (by path) otherwise.
    for (N, N_kv, G), paths in groups.items():
        if len(groups) == 1:
            prefix = "(.*/)?"
        else:
            if None in paths:
                raise ValueError("`target` holds DCMHA layers of different sizes; build it "
                                 "first so that each layer's variables can be matched by path.")
            prefix = "(" + "|".join(re.escape(p) for p in paths) + ")/(.*/)?"
        plan = sharding_plan(N, N_kv, G, P)
        for name, axis in plan.items():
            lm[prefix + _PATHS.get(name, name)] = _axes(_RANKS[name], axis, model_axis)
    from dcmha.models import DCFormerLM

    if isinstance(target, DCFormerLM):
        _add_lm_layouts(lm, target, P, model_axis)
    return lm


def _add_lm_layouts(lm, model, P, model_axis):
    """SwiGLU, embedding and output projection of a DCFormerLM."""
    from dcmha.models import default_intermediate_dim

    I = model.intermediate_dim or default_intermediate_dim(model.hidden_dim)
    V = model.vocab_size
    ffn = model_axis if I % P == 0 else None
    vocab = model_axis if V % P == 0 else None
    lm["(.*/)?feed_forward/(w1|w3)/kernel"] = (None, ffn)
    lm["(.*/)?feed_forward/w2/kernel"] = (ffn, None)
    lm["(.*/)?tok_embeddings/embeddings"] = (vocab, None)
    lm["(.*/)?output/kernel"] = (None, vocab)


def model_parallel(mesh, target, *, model_axis: str = "model", data_axis: Optional[str] = "data",
                   base=None, auto_shard_dataset: bool = True):
    """``keras.distribution.ModelParallel`` with ``layout_map(mesh, target, ...)``.

    The batch (axis 0 of every input) is split over ``data_axis``; with
    ``data_axis=None`` Keras uses the mesh's first axis.
    """
    lm = layout_map(mesh, target, model_axis=model_axis, data_axis=data_axis, base=base)
    return keras.distribution.ModelParallel(layout_map=lm, batch_dim_name=data_axis,
                                            auto_shard_dataset=auto_shard_dataset)


# ---------------------------------------------------------------------------
# Meshes that span processes (JAX multi-process)
# ---------------------------------------------------------------------------

def multi_host_mesh(model_size=None):
    """A ``keras.distribution.DeviceMesh`` of shape (data, model) over every process's
    devices: ``model`` within a process (heads and groups are exchanged at the speed of
    one machine), ``data`` across processes (only the gradients' reduction crosses them).

    Args:
        model_size: devices per model replica, a divisor of each process's device count;
            None: all of a process's devices.

    Call ``keras.distribution.initialize`` first. Rows of the mesh are consecutive
    devices of one process, ordered by process index.
    """
    import jax

    local = jax.local_device_count()
    model_size = local if model_size is None else model_size
    check_positive_int("model_size", model_size)
    if local % model_size:
        raise ValueError(f"`model_size` must divide the {local} devices of each process. "
                         f"Received: model_size={model_size}")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return keras.distribution.DeviceMesh((len(devices) // model_size, model_size),
                                         ("data", "model"), devices)


def gathered_weights(model):
    """The model's weights as NumPy arrays, whole on every process (``model.weights``
    order). Weights sharded over a mesh that spans processes are all-gathered in one
    compiled call, a collective that every process must make."""
    return framework.whole_values([v.value for v in model.weights])
