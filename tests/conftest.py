"""Shared fixtures. Keras is imported lazily: some test modules choose their own backend.

The layer tests run once per Keras backend, one process each:
``KERAS_BACKEND=jax pytest tests/layers`` (and torch, tensorflow; ``tools/test_all.py`` runs
every step). Test folders are packages (``tests.layers.test_layer_api``): a shared helper is
imported by its package path (``from tests import kernel_cases``).
"""

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "backend_independent: the test never touches the Keras backend (no Keras "
        "tensor, layer or op): tools/test_all.py runs it once, in the keras-numpy step, and "
        "deselects it in the other Keras backends' steps (-m 'not backend_independent')")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def reference_case(rng):
    """Factory: reference params and inputs for a config.

    ``reference_case(cfg_kwargs, B=2, T=6, S=None, D_q=16, D_kv=None, D_out=None,
    cross=False, scale=20.0)`` returns a dict with "cfg", "params", "query",
    "key", "value" (float32 arrays; key/value are the query for self-attention).
    ``scale`` makes the composition weights large, so compose is far from the
    identity and a wrong compose shows.
    """
    from dcmha.spec import reference

    def make(cfg_kwargs, B=2, T=6, S=None, D_q=16, D_kv=None, D_out=None, cross=False,
             scale=20.0):
        cfg = reference.Config(**cfg_kwargs).validate()
        D_kv = D_kv or D_q
        params = reference.init_params(cfg, D_q, D_kv, D_out, rng=rng, scale=scale)
        params = {n: p.astype(np.float32) for n, p in params.items()}
        query = rng.standard_normal((B, T, D_q)).astype(np.float32)
        if cross:
            S = S or T
            key = rng.standard_normal((B, S, D_kv)).astype(np.float32)
            value = rng.standard_normal((B, S, D_kv)).astype(np.float32)
        else:
            key = value = query
        return dict(cfg=cfg, params=params, query=query, key=key, value=value, cross=cross)

    return make


@pytest.fixture(scope="session")
def call_layer():
    """``call_layer(layer, *args, **kwargs)``: ``layer(*args, **kwargs)``, jitted under JAX.

    JAX runs eager Keras code one primitive at a time, compiling each for its
    shapes, which makes tests slow; one ``jax.jit`` of the whole call compiles
    once. Array keyword arguments (masks, caches) are traced, the rest static.
    The layer's non-trainable state (dropout seeds) is written back.
    """
    import keras

    if keras.backend.backend() != "jax":
        return lambda layer, *args, **kwargs: layer(*args, **kwargs)
    import jax

    compiled = {}

    def is_array(x):
        return hasattr(x, "shape") and hasattr(x, "dtype") or isinstance(x, dict)

    def call(layer, *args, **kwargs):
        arrays = {k: v for k, v in kwargs.items() if is_array(v)}
        static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
        if not layer.built:
            layer.build(*[None if a is None else tuple(a.shape) for a in args])
        key = (id(layer), static, tuple(sorted(arrays)))
        if key not in compiled:
            def f(tv, ntv, args, arrays):
                return layer.stateless_call(tv, ntv, *args, **arrays, **dict(static))
            compiled[key] = jax.jit(f)
        out, ntv = compiled[key]([v.value for v in layer.trainable_variables],
                                 [v.value for v in layer.non_trainable_variables],
                                 args, arrays)
        for var, value in zip(layer.non_trainable_variables, ntv):
            var.assign(value)
        return out

    return call


@pytest.fixture
def chosen(monkeypatch):
    """The names of the implementations ``dcmha.registry.select`` picks during the test, in
    call order (a spy: the picks themselves are unchanged). ``dcmha_attention`` reads
    ``select`` from the registry module at every call, so the spy replaces it there."""
    from dcmha import registry
    names = []
    real = registry.select

    def spy(implementation, call):
        name, fn = real(implementation, call)
        names.append(name)
        return name, fn

    monkeypatch.setattr(registry, "select", spy)
    return names
