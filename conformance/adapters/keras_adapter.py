"""Conformance adapters for the Keras ``dcmha.DCMHA`` layer: one per Keras backend
("keras-<backend>", ``implementation="auto"``, what users get), and one per registered
implementation ("impl-<name>", built by ``implementation_adapter``: the layer with
``implementation=<name>`` on that implementation's Keras backend).

Keras fixes its backend when it is first imported, so each adapter sets
KERAS_BACKEND before importing Keras and refuses to run in a process where
Keras was already imported with another backend (the suite runs every adapter
in its own subprocess). Keras is imported when an adapter is instantiated,
never when this module is imported.

The layer is built from ``case.config`` / ``case.dims``, loaded with
``case.params`` through ``load_spec_weights`` and run under the dtype policy of
the case (float16 / bfloat16: ``mixed_float16`` / ``mixed_bfloat16``, inputs
cast to that dtype). Gradients come from each backend's own autodiff
(``jax.grad``, torch autograd, ``tf.GradientTape``) of
``sum(output * d_output)``; the numpy backend has none.

Only the outputs the adapter is compared on are computed (``Adapter.wanted``): the layer is
asked for the attention scores only when a case compares them and the adapter has the
capability, so an implementation that never materialises them (and ``"auto"`` on long
cases) runs the case on its own path. An "impl-<name>" adapter's capabilities follow the
implementation's ``lacks`` (``capabilities_for``); it runs on the CPU (the runner sets the
implementation's ``cpu_env`` in the worker's environment before anything is imported).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Dict, Optional

import numpy as np

from dcmha.conformance.adapters.base import (CAPABILITIES, Adapter, cache_length, call_inputs,
                                             decode_segments, has_one_query_call)

_POLICIES = {"float32": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


def _import_keras(backend: str, adapter: str):
    """Keras on ``backend``; refuses if Keras already runs on another backend."""
    if "keras" in sys.modules:
        import keras

        current = keras.backend.backend()
        if current != backend:
            raise RuntimeError(
                f"The {adapter} adapter needs the Keras backend {backend!r}, but keras is already "
                f"imported with the backend {current!r} in this process; run the adapter in its "
                f"own process (the conformance runner does).")
        return keras
    os.environ["KERAS_BACKEND"] = backend
    import keras

    if keras.backend.backend() != backend:   # pragma: no cover - keras ignored the variable
        raise RuntimeError(f"Keras started with backend {keras.backend.backend()!r}, "
                           f"not {backend!r}.")
    return keras


class _KerasAdapter(Adapter):
    """The DCMHA Keras layer on one Keras backend (``backend``), run in a process of its
    own; subclasses name the backend and what it can run."""

    backend = ""
    capabilities = CAPABILITIES
    #: The layer's ``implementation`` argument.
    implementation = "auto"

    #: The implementation computes only one-query calls itself (``one_query_only``).
    one_query_only = False

    def __init__(self, implementation: Optional[str] = None, name: Optional[str] = None,
                 capabilities=None, one_query_only: bool = False):
        if implementation is not None:
            self.implementation = implementation
        if name is not None:
            self.name = name
        if capabilities is not None:
            self.capabilities = frozenset(capabilities)
        self.one_query_only = bool(one_query_only)
        self.keras = _import_keras(self.backend, self.name)
        self._strict_float32()

    def _strict_float32(self):
        """Float32 cases mean IEEE float32 matmuls (no TF32 on GPUs)."""

    def _inference(self):
        """The context of calls that need no gradient (torch: no autograd recording, which
        kernels that return non-differentiable attention scores refuse)."""
        return contextlib.nullcontext()

    def skip_reason(self, case) -> Optional[str]:
        """A one-query-only implementation skips the cases without a one-query call: it runs
        them through the plain core, which the keras-<backend> adapters cover."""
        if self.one_query_only and not has_one_query_call(case):
            return (f"no one-query call: {self.implementation!r} computes only those itself "
                    f"and runs the others through the plain core")
        return None

    # ------------------------------------------------------------- helpers
    def _layer(self, case):
        import dcmha

        dims = case.dims
        layer = dcmha.DCMHA(**case.config, output_shape=dims["output_dim"],
                            dtype=_POLICIES[case.dtype], implementation=self.implementation,
                            name="dcmha")
        if self.keras.backend.backend() != self.backend:
            raise RuntimeError(f"Keras backend changed to {self.keras.backend.backend()!r}")
        args = call_inputs(case)
        B, T, S = dims["batch"], dims["query_length"], dims["key_length"]
        D_q, D_kv = dims["query_input_dim"], dims["key_input_dim"]
        if args["value"] is None:
            layer.build((B, T, D_q), (B, T, D_q))
        else:
            layer.build((B, T, D_q), (B, S, D_kv), (B, S, D_kv))
        layer.load_spec_weights(case.params)
        return layer

    def _tensor(self, x, dtype):
        if x is None:
            return None
        x = np.asarray(x)
        if x.dtype == np.bool_:
            return self.keras.ops.convert_to_tensor(x)
        return self.keras.ops.cast(self.keras.ops.convert_to_tensor(x.astype(np.float32)), dtype)

    def _inputs(self, case):
        """(query, value, key, call kwargs) as backend tensors of the case's dtype."""
        args = call_inputs(case)
        q = self._tensor(args["query"], case.dtype)
        if args["value"] is None:
            value, key = q, None
        else:
            value, key = self._tensor(args["value"], case.dtype), self._tensor(args["key"],
                                                                              case.dtype)
        kwargs = dict(attention_mask=self._tensor(args["attention_mask"], "bool"),
                      use_causal_mask=args["use_causal_mask"])
        return q, value, key, kwargs

    def _np(self, x):
        return np.asarray(self.keras.ops.convert_to_numpy(self.keras.ops.cast(x, "float32")),
                          dtype=np.float32)

    # ---------------------------------------------------------------- run
    @contextlib.contextmanager
    def _recording_paths(self):
        """Record in ``self.paths`` the implementation every attention call of the block runs
        (what ``"auto"`` chose), by wrapping ``dcmha.registry.select`` for the block."""
        from dcmha import registry

        select, taken = registry.select, []

        def recording_select(implementation, call):
            name, fn = select(implementation, call)
            if name not in taken:
                taken.append(name)
            return name, fn

        registry.select = recording_select
        try:
            yield
        finally:
            registry.select = select
            self.paths = taken

    def run(self, case) -> Dict[str, np.ndarray]:
        if self.keras.backend.backend() != self.backend:
            raise RuntimeError(f"The {self.name} adapter needs Keras on {self.backend!r}.")
        with self._recording_paths():
            return self._run(case)

    def _run(self, case) -> Dict[str, np.ndarray]:
        if case.kind == "decode":
            with self._inference():
                return {"output": self._decode(case)}
        layer = self._layer(case)
        q, value, key, kwargs = self._inputs(case)
        out = {}
        wanted = set(self.wanted(case))
        with self._inference():
            if wanted & {"scores", "pre_composed", "probs"} or any(
                    n.startswith("dynamic/") for n in wanted):
                inter = layer.compute_intermediates(q, value, key, **kwargs)
                for n in ("output", "attention_scores", "scores", "pre_composed", "probs"):
                    out[n] = self._np(inter[n])
                for side in ("query_dynamic", "key_dynamic"):
                    for slot, ws in inter[side].items():
                        for w, a in ws.items():
                            out[f"dynamic/{slot}/{w}"] = self._np(a)
            elif "attention_scores" in wanted:
                y, scores = self._call(layer, q, value, key, return_attention_scores=True,
                                       **kwargs)
                out["output"], out["attention_scores"] = self._np(y), self._np(scores)
            else:
                out["output"] = self._np(self._call(layer, q, value, key, **kwargs))
        if case.kind == "gradients":
            out.update(self._weight_gradients(layer, self._gradients(case, layer)))
        return {n: out[n] for n in wanted if n in out}

    @staticmethod
    def _weight_gradients(layer, grads):
        """``grads`` ({"grad/<name>": array}, of the layer's variables) as the gradients of
        its weights: the composition weights are held divided by the layer's
        ``composition_lr_scale`` (``DynamicWeightProjection``), so a weight's gradient is
        its variable's divided by that scale."""
        from dcmha.layers.weights import composition_weights
        bare = {n[len("grad/"):]: g for n, g in grads.items()}
        scaled = composition_weights(bare, layer.composition_lr_scale, divide=True)
        return {f"grad/{n}": np.asarray(g, dtype=np.asarray(bare[n]).dtype)
                for n, g in scaled.items()}

    def _decode(self, case):
        layer = self._layer(case)
        query = case.inputs["query"]
        cache = layer.init_cache(query.shape[0], cache_length(case))
        outs = []
        for start, stop in decode_segments(case):
            x = self._tensor(query[:, start:stop], case.dtype)
            y, cache = self._call(layer, x, x, None, use_causal_mask=True, cache=cache,
                                  cache_update_index=start)
            outs.append(self._np(y))
        return np.concatenate(outs, axis=1)

    def _call(self, layer, query, value, key, **kwargs):
        """``layer(query, value, key, **kwargs)`` (arrays in ``kwargs`` are tensors)."""
        return layer(query, value, key, **kwargs)

    def _input_names(self, case):
        return ["query"] if case.call["self_attention"] else ["query", "key", "value"]

    def _variable_names(self, layer):
        """Canonical names of ``layer.trainable_variables``, in that order."""
        by_id = {id(v): n for n, v in layer._spec_variables().items()}
        names = [by_id.get(id(v)) for v in layer.trainable_variables]
        if None in names or sorted(names) != sorted(by_id.values()):
            raise RuntimeError("The trainable variables do not map onto the canonical names.")
        return names

    def _gradients(self, case, layer):
        raise NotImplementedError


class KerasJaxAdapter(_KerasAdapter):
    """The Keras layer on the JAX backend."""

    name = "keras-jax"
    backend = "jax"

    def _strict_float32(self):
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")

    def _call(self, layer, query, value, key, **kwargs):
        """The call compiled as one function (``jax.jit`` of ``stateless_call``), as a training
        or serving loop runs it: eager JAX dispatches every primitive on its own, which makes
        interpreted kernels (Pallas on a CPU) orders of magnitude slower."""
        import jax

        arrays = {n: a for n, a in kwargs.items() if n in ("attention_mask", "cache")}
        static = {n: a for n, a in kwargs.items() if n not in arrays}

        @jax.jit
        def call(trainable, non_trainable, query, value, key, arrays):
            out, _ = layer.stateless_call(trainable, non_trainable, query, value, key,
                                          **arrays, **static)
            return out

        return call([v.value for v in layer.trainable_variables],
                    [v.value for v in layer.non_trainable_variables], query, value, key, arrays)

    def _gradients(self, case, layer):
        import jax
        import jax.numpy as jnp

        q, value, key, kwargs = self._inputs(case)
        d_out = jnp.asarray(case.inputs["d_output"], jnp.float32)
        inputs = {"query": q} if case.call["self_attention"] else {
            "query": q, "key": key, "value": value}
        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def loss(trainable, inputs):
            qq = inputs["query"]
            args = (qq, qq) if case.call["self_attention"] else (qq, inputs["value"],
                                                                 inputs["key"])
            y, _ = layer.stateless_call(trainable, non_trainable, *args, **kwargs)
            return jnp.sum(y.astype(jnp.float32) * d_out)

        g_vars, g_inputs = jax.jit(jax.grad(loss, argnums=(0, 1)))(trainable, inputs)
        out = {f"grad/{n}": self._np(g_inputs[n]) for n in self._input_names(case)}
        out.update({f"grad/{n}": self._np(g)
                    for n, g in zip(self._variable_names(layer), g_vars)})
        return out


class KerasTorchAdapter(_KerasAdapter):
    """The Keras layer on the PyTorch backend."""

    name = "keras-torch"
    backend = "torch"

    def _strict_float32(self):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def _inference(self):
        import torch

        return torch.no_grad()

    def _gradients(self, case, layer):
        import torch

        q, value, key, kwargs = self._inputs(case)
        names = self._input_names(case)
        tensors = {"query": q, "key": key, "value": value}
        leaves = {n: tensors[n].detach().clone().requires_grad_(True) for n in names}
        for v in layer.trainable_variables:
            v.value.grad = None
        qq = leaves["query"]
        args = (qq, qq) if case.call["self_attention"] else (qq, leaves["value"], leaves["key"])
        y = layer(*args, **kwargs)
        d_out = torch.as_tensor(case.inputs["d_output"], dtype=torch.float32, device=y.device)
        torch.sum(y.float() * d_out).backward()
        out = {f"grad/{n}": self._np(leaves[n].grad) for n in names}
        for n, v in zip(self._variable_names(layer), layer.trainable_variables):
            out[f"grad/{n}"] = self._np(v.value.grad)
        return out


class KerasTensorFlowAdapter(_KerasAdapter):
    """The Keras layer on the TensorFlow backend."""

    name = "keras-tensorflow"
    backend = "tensorflow"

    def _strict_float32(self):
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)

    def _gradients(self, case, layer):
        import tensorflow as tf

        q, value, key, kwargs = self._inputs(case)
        names = self._input_names(case)
        tensors = {"query": q, "key": key, "value": value}
        d_out = tf.constant(case.inputs["d_output"], tf.float32)
        with tf.GradientTape() as tape:
            for n in names:
                tape.watch(tensors[n])
            args = (q, q) if case.call["self_attention"] else (q, value, key)
            y = layer(*args, **kwargs)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * d_out)
        variables = list(layer.trainable_variables)
        grads = tape.gradient(loss, [tensors[n] for n in names] + variables)
        out = {f"grad/{n}": self._np(g) for n, g in zip(names, grads)}
        out.update({f"grad/{n}": self._np(g)
                    for n, g in zip(self._variable_names(layer), grads[len(names):])})
        return out


class KerasNumpyAdapter(_KerasAdapter):
    """Inference only: the numpy backend has no autodiff."""

    name = "keras-numpy"
    backend = "numpy"
    capabilities = frozenset(CAPABILITIES - {"gradients"})


#: The adapter class of each Keras backend.
BACKEND_ADAPTERS = {a.backend: a for a in (KerasJaxAdapter, KerasTorchAdapter,
                                           KerasTensorFlowAdapter, KerasNumpyAdapter)}
#: Conformance capabilities an implementation loses with each capability it lacks
#: (``dcmha.registry.CAPABILITIES``); the others (dropout, per-head masks, traced offsets,
#: symbolic shapes) are never exercised by the fixtures.
_LOST_WITH = {"attention_scores": {"attention_scores"}, "intermediates": {"intermediates"},
              "query_offset": {"decode"}}


def capabilities_for(impl, backend: str = "") -> frozenset:
    """The conformance capabilities of the layer forced onto the implementation ``impl``
    (a ``dcmha.registry.Implementation``) on its Keras backend (``backend`` when it declares
    "any"): that backend's, less what ``impl.lacks`` takes away; "long_sequences" only for a
    path ``"auto"`` takes on a CPU (the long cases exist to cross those paths' size
    thresholds; interpreters and GPU-only paths skip them)."""
    caps = set(BACKEND_ADAPTERS[impl.backend if impl.backend != "any" else backend].capabilities)
    for lacked in impl.lacks:
        caps -= _LOST_WITH.get(lacked, set())
    if "cpu" not in impl.auto_devices:
        caps.discard("long_sequences")
    return frozenset(caps)


def _probe(layer_adapter) -> None:
    """Call the layer once, forced onto the adapter's implementation, on the simplest input:
    a RuntimeError with the reason when the implementation cannot run in this process."""
    import dcmha

    keras = layer_adapter.keras
    layer = dcmha.DCMHA(num_heads=2, key_dim=4, implementation=layer_adapter.implementation)
    layer.build((1, 4, 8), (1, 4, 8))
    x = keras.ops.ones((1, 4, 8), "float32")
    try:
        with layer_adapter._inference():
            keras.ops.convert_to_numpy(layer_adapter._call(layer, x, x, None))
    except Exception as e:
        raise RuntimeError(f"implementation {layer_adapter.implementation!r} cannot run here: "
                           f"{type(e).__name__}: {e}") from None


def implementation_adapter(implementation: str, backend: str = "") -> _KerasAdapter:
    """The "impl-<implementation>" adapter: the layer with ``implementation=<implementation>``
    on that implementation's Keras backend (``backend`` for one declared on "any"), with
    ``capabilities_for`` it. Raises (an import failure, for the runner) when the
    implementation cannot run in this process."""
    from dcmha import registry

    impls = registry.implementations()
    if implementation not in impls:
        raise RuntimeError(f"no implementation {implementation!r} is registered (registered: "
                           f"{', '.join(sorted(impls))})")
    impl = impls[implementation]
    on = impl.backend if impl.backend != "any" else backend
    if on not in BACKEND_ADAPTERS:
        raise RuntimeError(f"implementation {implementation!r} runs on the Keras backend "
                           f"{impl.backend!r}; give one of {sorted(BACKEND_ADAPTERS)}")
    name = f"impl-{implementation}" + (f"-{on}" if impl.backend == "any" else "")
    adapter = BACKEND_ADAPTERS[on](implementation=implementation, name=name,
                                   capabilities=capabilities_for(impl, on),
                                   one_query_only=impl.one_query_only)
    _probe(adapter)
    return adapter


__all__ = ["KerasJaxAdapter", "KerasTorchAdapter", "KerasTensorFlowAdapter", "KerasNumpyAdapter",
           "BACKEND_ADAPTERS", "capabilities_for", "implementation_adapter"]
