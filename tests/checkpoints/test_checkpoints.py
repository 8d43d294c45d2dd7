"""dcmha.checkpoints: official PyTorch DCFormer state dicts -> DCFormerLM.

The state dicts are built here with the official names and shapes (random
numbers); the expected logits come from an independent float64 NumPy forward of
the official architecture that uses dcmha.spec.reference.attention.
"""

import numpy as np
import pytest

import keras
from keras import ops

from dcmha.checkpoints import (from_official_state_dict, official_config_to_kwargs,
                               to_official_state_dict)
from dcmha.spec import reference

BACKEND = keras.backend.backend()

# An official-style config: the keys that matter plus unrelated Hugging Face keys.
CONFIG_A = dict(vocab_size=41, n_layer=3, n_head=4, n_local_heads=2, dim=32, head_dim=64,
                intermediate_size=None, rope_base=10000.0, norm_eps=1e-5, use_qk_norm=True,
                window_size=3, window_type=None, tie_word_embeddings=False, mgate=False,
                query_wise=False, use_dcmha=True, block_size=64, q_chunk_size=128,
                model_type="dcformer", architectures=["DCFormer"], torch_dtype="bfloat16",
                bos_token_id=1, eos_token_id=2, use_gradient_checkpointing=False)
# Separate wq/wk/wv, n_local_heads -1, 2 groups, rank 1, tied embeddings, LGLL.
CONFIG_B = dict(vocab_size=29, n_layer=4, n_head=4, n_local_heads=-1, dim=24,
                intermediate_size=40, rope_base=500000, norm_eps=1e-6, use_qk_norm=False,
                window_size=2, window_type="LGLL", tie_word_embeddings=True)


def sizes(config, G=1, R=2):
    kw = official_config_to_kwargs(config)
    N = kw["num_heads"]
    return dict(V=kw["vocab_size"], L=kw["num_layers"], D=kw["hidden_dim"], N=N,
                N_kv=kw["num_key_value_heads"] or N, d=kw["head_dim"],
                I=kw["intermediate_dim"], G=G, M=N // G, R=R, K=2 * R * (N // G))


def official_state_dict(config, fused=True, G=1, R=2, seed=0, extras=True):
    """Random weights in the official layout (names and shapes)."""
    s = sizes(config, G, R)
    V, L, D, N, N_kv, d, I, M, K = (s[k] for k in ("V", "L", "D", "N", "N_kv", "d", "I", "M", "K"))
    rng = np.random.default_rng(seed)

    def n(*shape, std=1.0):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    sd = {"tok_embeddings.weight": n(V, D), "norm.weight": 1 + n(D, std=0.1)}
    if not config.get("tie_word_embeddings"):
        sd["output.weight"] = n(V, D, std=D ** -0.5)
    for i in range(L):
        p, a = f"layers.{i}.", f"layers.{i}.attention."
        if fused:
            sd[a + "wqkv.weight"] = n((N + 2 * N_kv) * d, D, std=D ** -0.5)
        else:
            sd.update({a + "wq.weight": n(N * d, D, std=D ** -0.5),
                       a + "wk.weight": n(N_kv * d, D, std=D ** -0.5),
                       a + "wv.weight": n(N_kv * d, D, std=D ** -0.5)})
        sd[a + "wo.weight"] = n(D, N * d, std=(N * d) ** -0.5)
        if config.get("use_dcmha", True):
            # Large composition weights, so that a wrong layout changes the logits.
            sd[a + "dyn_w_proj.dw1"] = n(D, G, 4, K, std=D ** -0.5)
            sd[a + "dyn_w_proj.qkw"] = n(G, 4, K, 2 * R, M, std=0.3)
            sd[a + "dyn_w_proj.dd"] = n(D, G, 4 * M, std=D ** -0.5)
            if extras:   # derived copies the converter must ignore
                sd[a + "dyn_w_proj.dw_m"] = n(D, 2 * G * 4 * K)
                sd[a + "dyn_w_proj.qkw_m"] = n(K, 8 * M)
                sd[a + "dyn_w_proj.pre_proj.w"] = np.tile(np.eye(M, dtype=np.float32), (G, 1, 1))
                sd[a + "dyn_w_proj.post_proj.w"] = np.tile(np.eye(M, dtype=np.float32), (G, 1, 1))
        if config.get("use_qk_norm"):
            sd[a + "q_norm.scale"] = 1 + n(d, std=0.2)
            sd[a + "k_norm.scale"] = 1 + n(d, std=0.2)
        if extras:
            sd[a + "kv_cache.k_cache"] = np.zeros((1, N_kv, 8, d), np.float32)
            sd[a + "kv_cache.v_cache"] = np.zeros((1, N_kv, 8, d), np.float32)
        sd[p + "attention_norm.weight"] = 1 + n(D, std=0.1)
        sd[p + "ffn_norm.weight"] = 1 + n(D, std=0.1)
        sd[p + "feed_forward.w1.weight"] = n(I, D, std=D ** -0.5)
        sd[p + "feed_forward.w3.weight"] = n(I, D, std=D ** -0.5)
        sd[p + "feed_forward.w2.weight"] = n(D, I, std=I ** -0.5)
    return sd


def official_forward(sd, config, ids, G=1, R=2):
    """The official DCFormer forward in float64 NumPy (attention: reference.attention)."""
    s = sizes(config, G, R)
    D, N, N_kv, d = s["D"], s["N"], s["N_kv"], s["d"]
    eps = config["norm_eps"]
    f = {k: np.asarray(v, np.float64) for k, v in sd.items()}

    def rms(x, w, e):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + e) * w

    pattern = config.get("window_type") or "LG"
    x = f["tok_embeddings.weight"][ids]
    for i in range(s["L"]):
        p, a = f"layers.{i}.", f"layers.{i}.attention."
        if a + "wqkv.weight" in f:
            w = f[a + "wqkv.weight"]
            wq, wk, wv = w[:N * d], w[N * d:(N + N_kv) * d], w[(N + N_kv) * d:]
        else:
            wq, wk, wv = f[a + "wq.weight"], f[a + "wk.weight"], f[a + "wv.weight"]
        # torch Linear: y = x W^T, output features head-major (n, h).
        params = {"query_kernel": wq.T.reshape(D, N, d), "key_kernel": wk.T.reshape(D, N_kv, d),
                  "value_kernel": wv.T.reshape(D, N_kv, d),
                  "output_kernel": f[a + "wo.weight"].T.reshape(N, d, D)}
        dcmha = config.get("use_dcmha", True)
        if dcmha:
            params.update(dw1=f[a + "dyn_w_proj.dw1"], qkw=f[a + "dyn_w_proj.qkw"],
                          dd=f[a + "dyn_w_proj.dd"])
        if config.get("use_qk_norm"):
            params.update(query_norm_scale=f[a + "q_norm.scale"],
                          key_norm_scale=f[a + "k_norm.scale"])
        local = pattern[i % len(pattern)] == "L" and config.get("window_size") is not None
        cfg = reference.Config(num_heads=N, key_dim=d, num_key_value_heads=N_kv, num_groups=G,
                               rank=R, pre_compose=dcmha, post_compose=dcmha,
                               gelu_approximate=False, qk_norm=bool(config.get("use_qk_norm")),
                               rope_max_wavelength=config["rope_base"],
                               sliding_window=config["window_size"] if local else None)
        h = rms(x, f[p + "attention_norm.weight"], eps)
        x = x + reference.attention(params, cfg, h, use_causal_mask=True)
        h = rms(x, f[p + "ffn_norm.weight"], eps)
        g = h @ f[p + "feed_forward.w1.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ f[p + "feed_forward.w3.weight"].T)) \
            @ f[p + "feed_forward.w2.weight"].T
    x = rms(x, f["norm.weight"], eps)
    out = f["tok_embeddings.weight"] if config.get("tie_word_embeddings") else f["output.weight"]
    return x @ out.T


def logits(model, ids):
    return np.asarray(ops.convert_to_numpy(model(ids)), np.float64)


def ids_for(config, shape=(2, 7), seed=1):
    return np.random.default_rng(seed).integers(0, config["vocab_size"], shape).astype("int32")


class FakeTensor:
    """Duck-typed stand-in for a torch tensor (detach / cpu / numpy)."""

    def __init__(self, a):
        self.a, self.dtype = a, "torch.float32"

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.a


@pytest.mark.parametrize("case", ["A-fused-gqa-qknorm-LG", "B-separate-groups-rank1-tied-LGLL",
                                  "C-mha"])
def test_converted_logits_equal_official_forward(case):
    if case.startswith("A"):
        config, kw = CONFIG_A, dict(fused=True)
    elif case.startswith("B"):
        config, kw = CONFIG_B, dict(fused=False, G=2, R=1)
    else:
        config, kw = dict(CONFIG_A, use_dcmha=False, use_qk_norm=False), dict(fused=True)
    sd = official_state_dict(config, **kw)
    model = from_official_state_dict({k: FakeTensor(v) for k, v in sd.items()}, config)
    ids = ids_for(config)
    want = official_forward(sd, config, ids, G=kw.get("G", 1), R=kw.get("R", 2))
    got = logits(model, ids)
    assert got.shape == (2, 7, config["vocab_size"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_config_mapping():
    kw = official_config_to_kwargs(CONFIG_A)
    assert kw == dict(vocab_size=41, num_layers=3, hidden_dim=32, num_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_dim=256,
                      sliding_window=3, window_pattern="LG", qk_norm=True,
                      rope_max_wavelength=10000.0, norm_eps=1e-5, tie_embeddings=False,
                      attention="dcmha")
    model = from_official_state_dict(official_state_dict(CONFIG_A), CONFIG_A)
    assert model.layer_sliding_windows() == [3, None, 3]
    assert model.blocks[0].attention.gelu_approximate is False
    b = official_config_to_kwargs(CONFIG_B)
    assert b["window_pattern"] == "LGLL" and b["num_key_value_heads"] is None
    # Defaults of the official DCFormerConfig for absent keys.
    d = official_config_to_kwargs(dict(vocab_size=10, n_layer=1, n_head=2, dim=8))
    assert (d["rope_max_wavelength"], d["norm_eps"], d["sliding_window"], d["intermediate_dim"]) \
        == (500000.0, 1e-5, 256, 256)

    class HFConfig:   # an attribute-style config object
        def __init__(self, **kw):
            self.__dict__.update(kw)
    assert official_config_to_kwargs(HFConfig(**CONFIG_A)) == kw


def test_group_and_rank_come_from_the_weights():
    sd = official_state_dict(CONFIG_B, fused=False, G=2, R=1, extras=False)
    model = from_official_state_dict(sd, CONFIG_B)
    att = model.blocks[0].attention
    assert (att.num_groups, att.rank) == (2, 1)


def test_round_trip_to_official_layout():
    sd = official_state_dict(CONFIG_A, extras=False)
    model = from_official_state_dict(sd, CONFIG_A)
    back = to_official_state_dict(model)
    assert set(back) == set(sd)
    scale = model.blocks[0].attention.composition_lr_scale
    assert scale == 0.1                   # the default parametrisation of the composition
    for k in sd:
        # Exact, but for the composition weights (dyn_w_proj.*), which the layers hold
        # divided by their scale: rounded once into the variable and once out of it.
        rtol = np.finfo(np.float32).eps if ".dyn_w_proj." in k else 0
        np.testing.assert_allclose(back[k], sd[k], rtol=rtol, atol=0, err_msg=k)
    # With the parametrisation off the round trip is exact for every weight.
    plain = from_official_state_dict(sd, CONFIG_A, composition_lr_scale=1.0)
    for k, w in to_official_state_dict(plain).items():
        np.testing.assert_array_equal(w, sd[k], err_msg=k)


@pytest.mark.skipif(BACKEND != "torch", reason="real torch tensors only in the torch process")
def test_real_torch_tensors():
    import torch
    sd = official_state_dict(CONFIG_A)
    model = from_official_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, CONFIG_A)
    ids = ids_for(CONFIG_A)
    np.testing.assert_allclose(logits(model, ids), official_forward(sd, CONFIG_A, ids),
                               rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

def _convert_error(sd, config=CONFIG_A):
    with pytest.raises(ValueError) as e:
        from_official_state_dict(sd, config)
    return str(e.value)


def test_missing_entry():
    sd = official_state_dict(CONFIG_A)
    del sd["layers.1.feed_forward.w2.weight"]
    assert _convert_error(sd) == ("Missing state_dict entry 'layers.1.feed_forward.w2.weight' "
                                  "(expected shape (32, 256)).")
    sd = official_state_dict(CONFIG_A)
    del sd["layers.0.attention.dyn_w_proj.dw1"]
    assert _convert_error(sd).startswith(
        "Missing state_dict entry 'layers.0.attention.dyn_w_proj.dw1'")


def test_unexpected_entry():
    sd = official_state_dict(CONFIG_A)
    sd["layers.0.attention.rotary.inv_freq"] = np.zeros(4, np.float32)
    sd["layers.3.ffn_norm.weight"] = np.zeros(32, np.float32)     # a 4th layer in a 3-layer config
    assert _convert_error(sd) == (
        "Unexpected state_dict entries (not part of the official DCFormer layout for this "
        "config): ['layers.0.attention.rotary.inv_freq', 'layers.3.ffn_norm.weight']")


def test_mis_shaped_entry():
    sd = official_state_dict(CONFIG_A)
    sd["layers.2.attention.wqkv.weight"] = sd["layers.2.attention.wqkv.weight"][:-1]
    assert _convert_error(sd) == ("state_dict['layers.2.attention.wqkv.weight'] has shape "
                                  "(63, 32); expected (64, 32) for this config.")
    sd = official_state_dict(CONFIG_A)
    sd["layers.1.attention.dyn_w_proj.dd"] = np.zeros((32, 1, 15), np.float32)
    assert "state_dict['layers.1.attention.dyn_w_proj.dd'] has shape (32, 1, 15)" in \
        _convert_error(sd)


@pytest.mark.parametrize("change,message", [
    (dict(mgate=True), "Unsupported DCFormer config: mgate=True"),
    (dict(query_wise=True), "Unsupported DCFormer config: query_wise=True"),
    (dict(window_type="LXG"), "window_type must be None or a string of 'L' and 'G'"),
    (dict(n_local_heads=3), "Config 'n_local_heads' (3) must be -1 or divide 'n_head' (4)."),
    (dict(dim=30), "Config 'dim' (30) must be divisible by 'n_head' (4)."),
])
def test_unsupported_config(change, message):
    assert message in _convert_error(official_state_dict(CONFIG_A), dict(CONFIG_A, **change))


def test_static_composition_is_rejected():
    sd = official_state_dict(CONFIG_A)
    sd["layers.0.attention.dyn_w_proj.pre_proj.w"] = sd[
        "layers.0.attention.dyn_w_proj.pre_proj.w"] * 2
    assert _convert_error(sd) == (
        "state_dict['layers.0.attention.dyn_w_proj.pre_proj.w'] is not the identity: static "
        "composition weights are not supported by from_official_state_dict.")


def test_tied_output_must_match_embeddings():
    sd = official_state_dict(CONFIG_B, fused=False, G=2, R=1)
    sd["output.weight"] = sd["tok_embeddings.weight"].copy()
    from_official_state_dict(sd, CONFIG_B)                       # an identical copy is fine
    sd["output.weight"] = sd["output.weight"] + 1
    assert "differs from 'tok_embeddings.weight'" in _convert_error(sd, CONFIG_B)


_BOOL = "a bool (True or False; strings and numbers are not accepted)"


@pytest.mark.parametrize("change,message", [
    # Values are checked, never coerced: int(4.7) is 4, bool("false") is True.
    (dict(n_local_heads=4.7), "Config key 'n_local_heads' must be None, -1 or a positive "
                              "integer. Received: 4.7"),
    (dict(n_local_heads=True), "Config key 'n_local_heads' must be None, -1 or a positive "
                               "integer. Received: True"),
    (dict(n_local_heads=-2), "Config key 'n_local_heads' must be None, -1 or a positive "
                             "integer. Received: -2"),
    (dict(use_dcmha="false"), f"Config key 'use_dcmha' must be {_BOOL}. Received: 'false'"),
    (dict(use_qk_norm=1), f"Config key 'use_qk_norm' must be {_BOOL}. Received: 1"),
    (dict(tie_word_embeddings=None),
     f"Config key 'tie_word_embeddings' must be {_BOOL}. Received: None"),
    (dict(mgate="no"), f"Config key 'mgate' must be {_BOOL}. Received: 'no'"),
    (dict(query_wise=0), f"Config key 'query_wise' must be {_BOOL}. Received: 0"),
    (dict(dim=32.0), "Config key 'dim' must be a positive integer. Received: 32.0"),
    (dict(window_size=3.5), "Config key 'window_size' must be None or a positive integer. "
                            "Received: 3.5"),
    (dict(rope_base=True), "Config key 'rope_base' must be a positive number. Received: True"),
    (dict(norm_eps=float("nan")), "Config key 'norm_eps' must be a positive number. "
                                  "Received: nan"),
])
def test_config_values_are_type_checked(change, message):
    with pytest.raises(ValueError) as e:
        official_config_to_kwargs(dict(CONFIG_A, **change))
    assert str(e.value) == message


def test_config_accepts_numpy_scalars_and_strict_bools():
    # A config read through NumPy (np.int64, np.bool_) is as valid as plain Python values.
    kw = official_config_to_kwargs(dict(CONFIG_A, n_local_heads=np.int64(2), dim=np.int64(32),
                                        use_qk_norm=np.bool_(True), use_dcmha=False))
    assert (kw["num_key_value_heads"], kw["hidden_dim"], kw["qk_norm"], kw["attention"]) == \
        (2, 32, True, "mha")
    assert official_config_to_kwargs(dict(CONFIG_A, n_local_heads=None))[
        "num_key_value_heads"] is None
