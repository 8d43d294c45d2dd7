"""generate's one-token steps take the attention core's one-query path (issue 15), on every
Keras backend.

The compiled steps must know T = 1 statically: on tensorflow the prompt and the one-token
steps are traced as separate functions (one relaxed trace would lose T = 1), on jax the step
is jitted per shape with its cache donated. Greedy generation still equals the argmax of the
model's full forward pass (no cache), also when generate runs twice on one model.
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

from dcmha.models import DCFormerLM  # noqa: E402
from tests.layers.test_layer_decode_one_query import one_query_calls  # noqa: E402, F401 (a fixture)

LAYERS, NEW = 2, 4


def test_generate_steps_use_the_one_query_path(one_query_calls):  # noqa: F811
    calls = one_query_calls
    keras.utils.set_random_seed(0)
    lm = DCFormerLM(vocab_size=32, num_layers=LAYERS, hidden_dim=16, num_heads=4,
                    intermediate_dim=32)
    prompt = np.random.default_rng(0).integers(0, 32, size=(2, 5)).astype("int32")
    ids = lm.generate(prompt, NEW)
    assert ids.shape == (2, 5 + NEW)
    # Each layer runs the path once per step (traced backends: once per trace).
    traced = keras.backend.backend() in ("jax", "tensorflow")
    assert len(calls) == LAYERS * (1 if traced else NEW - 1)

    # Greedy decoding: each new token is the argmax of the full forward pass's last logits.
    logits = np.asarray(ops.convert_to_numpy(lm(ops.convert_to_tensor(ids[:, :-1]))))
    np.testing.assert_array_equal(ids[:, 5:], np.argmax(logits[:, 4:], axis=-1))
    np.testing.assert_array_equal(lm.generate(prompt, NEW), ids)      # a fresh cache each call


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's eager steps")
def test_torch_generate_steps_record_no_gradient(monkeypatch):
    """generate's eager torch steps run under torch.no_grad(): no autograd state is built
    (and the compiled decode kernels, which record none, are taken)."""
    import torch

    keras.utils.set_random_seed(0)
    lm = DCFormerLM(vocab_size=32, num_layers=LAYERS, hidden_dim=16, num_heads=4,
                    intermediate_dim=32)
    lm.build((1, None))
    assert torch.is_grad_enabled()
    seen = []
    inner = lm.call_with_cache
    monkeypatch.setattr(lm, "call_with_cache", lambda *a: seen.append(
        torch.is_grad_enabled()) or inner(*a))
    step = lm._decode_function()
    last, cache = step(ops.convert_to_tensor(np.zeros((1, 3), "int32")), lm.init_cache(1, 8), 0)
    assert seen == [False] and torch.is_grad_enabled()
    assert not last.requires_grad
    assert not any(v.requires_grad for v in keras.tree.flatten(cache))
