"""The DCMHA layer on a GPU: "auto" takes the backend's fused kernel, at the spec's numbers.

Runs on the Keras backend of the process when it sees a GPU (torch: Triton; jax: Pallas);
skipped otherwise. The layer's output and its gradients w.r.t. the input and every weight are
compared with the same layer on the plain "ops" core, on the same device, and its output with
the NumPy spec. Run each backend in its own process, this module alone for torch (Triton is
loaded compiled, not interpreted).
"""

import os

import numpy as np
import pytest

import keras
from keras import ops

BACKEND = keras.backend.backend()
KERNELS = {"torch": "triton", "jax": "pallas"}


def _gpu_kernel():
    """The fused kernel "auto" takes here, or None; float32 matrix products in full precision
    (no TF32), so the layer's projections can be compared with the float64 spec."""
    if BACKEND == "torch":
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return None
        return "triton" if torch.cuda.is_available() else None
    if BACKEND == "jax":
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")
        return "pallas" if jax.default_backend() == "gpu" else None
    return None


KERNEL = _gpu_kernel()
if KERNEL is None:
    pytest.skip(f"needs a GPU that the {BACKEND} backend's fused kernel runs on",
                allow_module_level=True)

from dcmha.layers import DCMHA  # noqa: E402
from dcmha.spec import reference  # noqa: E402

CONFIG = dict(num_heads=8, key_dim=32, num_key_value_heads=4, num_groups=2,
              static_compose=True)


def _np(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), np.float64)


def _value_and_grads(layer, x, mask):
    """(output, [d loss / d x] + [d loss / d w for w in trainable weights]), loss = sum(y * c)."""
    c = np.random.default_rng(9).standard_normal(x.shape).astype("float32")   # D_out = D
    if BACKEND == "torch":
        import torch
        xt = torch.tensor(x, device="cuda", requires_grad=True)
        y = layer(xt, xt, attention_mask=mask, use_causal_mask=True)
        weights = [w.value for w in layer.trainable_weights]
        grads = torch.autograd.grad((y * torch.tensor(c, device="cuda")).sum(), [xt] + weights)
        return _np(y), [_np(g) for g in grads]
    import jax
    values = [w.value for w in layer.trainable_weights]

    def loss(x, values):
        y, _ = layer.stateless_call(values, [], x, x, attention_mask=mask, use_causal_mask=True)
        return (y * c).sum(), y

    (_, y), (gx, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jax.numpy.asarray(x), values)
    return _np(y), [_np(gx)] + [_np(g) for g in gw]


def test_auto_takes_the_kernel_and_matches_ops_and_spec(chosen):
    rng = np.random.default_rng(0)
    B, T, D = 2, 200, 256
    cfg = reference.Config(**CONFIG).validate()
    params = {n: p.astype(np.float32) for n, p in
              reference.init_params(cfg, D, D, None, rng=rng, scale=5.0).items()}
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    mask = rng.random((B, T, T)) < 0.9
    mask[1, 17] = False
    results, picks = {}, {}
    for impl in ("auto", "ops"):
        del chosen[:]
        layer = DCMHA(**CONFIG, implementation=impl)
        layer.build((B, T, D), (B, T, D))
        layer.load_spec_weights(params)
        results[impl] = _value_and_grads(layer, x, mask)
        picks[impl] = set(chosen)
    assert picks == {"auto": {KERNEL}, "ops": {"ops"}}, picks
    y_ref = reference.attention(params, cfg, x, attention_mask=mask, use_causal_mask=True)
    (y_auto, g_auto), (y_ops, g_ops) = results["auto"], results["ops"]
    scale = np.abs(y_ref).max()
    np.testing.assert_allclose(y_auto, y_ref, rtol=1e-4, atol=1e-4 * scale)
    np.testing.assert_allclose(y_ops, y_ref, rtol=1e-4, atol=1e-4 * scale)
    assert len(g_auto) == len(g_ops) > 1
    for i, (ga, go) in enumerate(zip(g_auto, g_ops)):
        np.testing.assert_allclose(ga, go, rtol=1e-3, atol=1e-3 * max(1.0, np.abs(go).max()),
                                   err_msg=f"gradient {i}")
