"""Tiny checkpoint directories in the authors' release layout, for the tests.

config.json (an official config), the weights (random, official names and
shapes, from test_checkpoints.official_state_dict, with the derived copies
dw_m / qkw_m the authors' files hold; in .bin files qkw_m is a view of qkw's
storage, as there) written by `dcmha.checkpoints.write_official_directory`
(NumPy only), and a small BPE tokenizer.json trained here with `tokenizers`.
"""

import numpy as np

from dcmha.checkpoints import write_official_directory
from tests.checkpoints.test_checkpoints import official_state_dict

#: 2 layers, D=32, 4 heads of 8, GQA 2, QK-norm, a sliding window: small and complete.
TINY_CONFIG = dict(vocab_size=96, n_layer=2, n_head=4, n_local_heads=2, dim=32,
                   intermediate_size=64, rope_base=10000.0, norm_eps=1e-6, use_qk_norm=True,
                   window_size=4, window_type=None, tie_word_embeddings=False, mgate=False,
                   query_wise=False, use_dcmha=True, block_size=64, model_type="dcformer",
                   architectures=["DCFormer"], torch_dtype="bfloat16", bos_token_id=1,
                   eos_token_id=2)

CORPUS = ("the quick brown fox jumps over the lazy dog. a dog and a fox are friends. "
          "dynamically composable attention mixes the heads of every position. ") * 4


def tiny_tokenizer(vocab_size=TINY_CONFIG["vocab_size"]):
    """A BPE tokenizer (Metaspace words) trained on CORPUS; ids 0, 1, 2 are
    <unk>, <s>, </s>, matching TINY_CONFIG's bos/eos ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def tiny_state_dict(config=TINY_CONFIG, seed=0):
    """Official-layout weights (float32) with the dw_m / qkw_m copies dropped:
    write_release_dir adds them the way the release files hold them."""
    sd = official_state_dict(config, seed=seed)
    return {k: v for k, v in sd.items() if not k.endswith(("dw_m", "qkw_m"))}


def write_release_dir(directory, state_dict, config=TINY_CONFIG, *, format="safetensors",
                      dtype="float32", num_shards=1, tokenizer=True):
    """A release-layout directory holding `state_dict`, plus the derived copies:
    dw_m (its own storage) and qkw_m (in .bin a view of qkw, as in the official
    code; a copy in safetensors, which has no views)."""
    sd, views = dict(state_dict), {}
    for i in range(config["n_layer"]):
        a = f"layers.{i}.attention.dyn_w_proj."
        qkw = sd[a + "qkw"]
        G, C, K, R2, M = qkw.shape
        D = sd[a + "dw1"].shape[0]
        sd[a + "dw_m"] = np.concatenate([sd[a + "dw1"].reshape(D, -1),
                                         sd[a + "dd"].reshape(D, -1)], axis=1)
        if format == "bin":
            # (G*C*K, 2R*M) view of qkw's contiguous storage.
            views[a + "qkw_m"] = (a + "qkw", 0, (G * C * K, R2 * M), (R2 * M, 1))
        else:
            sd[a + "qkw_m"] = qkw.reshape(G * C * K, R2 * M).copy()
    return write_official_directory(
        directory, sd, config, format=format, dtype=dtype, num_shards=num_shards,
        views=views or None, tokenizer_json=tiny_tokenizer() if tokenizer else None)


def rounded(state_dict, dtype):
    """The float32 values a `dtype` checkpoint of `state_dict` holds."""
    from dcmha.checkpoints.files import bfloat16_to_float32, float32_to_bfloat16

    if dtype == "bfloat16":
        return {k: bfloat16_to_float32(float32_to_bfloat16(v)).reshape(v.shape)
                for k, v in state_dict.items()}
    return {k: np.asarray(v).astype(dtype).astype(np.float32) for k, v in state_dict.items()}
