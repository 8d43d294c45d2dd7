"""Generation with a DCFormer language model: one prefill of the prompt, then one cached
step per new token. `DCFormerLM.generate` is `generate` here; the step itself comes from
the framework seam (``dcmha.framework.decode_step``: compiled where that pays) and reads
and writes the per-layer DCMHA caches of ``DCFormerLM.init_cache``.
"""

from __future__ import annotations

import math

import numpy as np

import keras
from keras import ops

from dcmha import framework

__all__ = ["generate", "check_token_range"]


def check_token_range(ids, vocab_size):
    """ValueError when a token id (NumPy array) is outside [0, vocab_size)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"`token_ids` must be in [0, vocab_size) = [0, {vocab_size}). "
                         f"Received: token_ids with min={ids.min()}, max={ids.max()}")


def _check_arguments(ids, max_new_tokens, temperature, vocab_size):
    if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError("`token_ids` must be an integer array of shape (B, T) with T >= 1. "
                         f"Received: shape={ids.shape}, dtype={ids.dtype}")
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
            or max_new_tokens < 0):
        raise ValueError("`max_new_tokens` must be a non-negative integer. Received: "
                         f"max_new_tokens={max_new_tokens!r}")
    if (isinstance(temperature, bool)
            or not isinstance(temperature, (int, float, np.integer, np.floating))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError("`temperature` must be a finite number >= 0. "
                         f"Received: temperature={temperature!r}")
    check_token_range(ids, vocab_size)


def generate(model, token_ids, max_new_tokens, temperature=0.0, seed=None):
    """Continue `token_ids` (B, T) by `max_new_tokens` tokens with ``model`` (a
    `DCFormerLM`: ``init_cache``, ``call_with_cache``, ``vocab_size``).

    One prefill of the prompt, then one cached step per new token (keys,
    values and key-side dynamic weights of earlier positions are never
    recomputed). temperature 0 is greedy (argmax); > 0 samples from
    softmax(logits / temperature) with `seed`. On jax and tensorflow the
    step is compiled once per call.

    Returns:
        int32 NumPy array (B, T + max_new_tokens): the prompt then the new tokens.
    """
    ids = np.asarray(token_ids if isinstance(token_ids, np.ndarray)
                     else ops.convert_to_numpy(token_ids))
    _check_arguments(ids, max_new_tokens, temperature, model.vocab_size)
    ids = ids.astype("int32")
    B, T = ids.shape
    if max_new_tokens == 0:
        return ids
    if not model.built:
        model.build((B, None))
    step = model._decode_function()
    rng = keras.random.SeedGenerator(seed) if temperature > 0 else None

    index = framework.step_index
    cache = model.init_cache(B, T + max_new_tokens)
    last, cache = step(ops.convert_to_tensor(ids), cache, index(0))      # prefill
    out = [ids]
    for i in range(max_new_tokens):
        if temperature > 0:
            tok = keras.random.categorical(last / temperature, 1, seed=rng, dtype="int32")
        else:
            tok = ops.expand_dims(ops.cast(ops.argmax(last, axis=-1), "int32"), -1)
        tok = np.asarray(ops.convert_to_numpy(tok), dtype="int32")
        out.append(tok)
        if i + 1 < max_new_tokens:
            last, cache = step(ops.convert_to_tensor(tok), cache, index(T + i))
    return np.concatenate(out, axis=1)
