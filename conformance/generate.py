"""Generate the conformance fixtures from the NumPy reference (deterministically).

    python -m dcmha.conformance.generate              # rewrite conformance/fixtures/
    python -m dcmha.conformance.generate --check      # regenerate in a temp dir, compare bytes
    python -m dcmha.conformance.generate --out DIR    # write elsewhere

Every case is a short declaration below (``CASES``): a config, dims, call options and a kind.
``build`` draws inputs and parameters from a generator seeded by the case name, computes the
float64 reference (and, for some, its gradients), checks the invariants the case relies on
(compose really changes the numbers, chunking and decoding reproduce the full forward), and
stores everything as float32. Files are written byte-reproducibly: .npy headers and the zip
container are built here with fixed timestamps, JSON has sorted keys and short floats.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import io
import json
import struct
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from dcmha.spec import reference as ref
from dcmha.spec import tolerance as tol
from dcmha.conformance.adapters.base import LONG_LENGTH_PRODUCT
from dcmha.conformance.cases import FIXTURES_DIR, MANIFEST_NAME

#: Multipliers of the reference initialisation of the composition weights, chosen so that each
#: compose term changes the scores / probabilities by tens of percent (DCMHA's own init starts
#: at MHA, where a missing term would be invisible) while probabilities stay moderate.
GAINS = {"dw1": 1.0, "qkw": 40.0, "dd": 60.0, "static": 4.0}
BASE_CONFIG = dict(num_heads=4, key_dim=8)
BASE_DIMS = dict(batch=2, query_length=8, key_length=8, query_input_dim=12, key_input_dim=12)
#: A compose stage that is on must change its input by at least this fraction of its max.
MIN_COMPOSE_EFFECT = 0.05
#: Decode and chunked results must match the full forward to this (float64).
INVARIANCE_ATOL = 1e-12
TOLERANCE_POLICY = ("pass iff |got - expected| <= atol + rtol*|expected| elementwise; "
                    "rtol = c*u*kappa, atol = rtol*max(max|expected|, floor); "
                    "see dcmha.spec.tolerance")


@dataclasses.dataclass(frozen=True)
class Spec:
    """The declaration of one case."""

    name: str
    description: str
    kind: str = "forward"                 # "forward" | "gradients" | "decode"
    dtype: str = "float32"
    config: dict = dataclasses.field(default_factory=dict)   # overrides of BASE_CONFIG
    dims: dict = dataclasses.field(default_factory=dict)     # overrides of BASE_DIMS
    self_attention: bool = True
    causal: bool = False
    mask: Optional[str] = None            # None | "padding" | "random" | "fully_masked"
    decode_steps: Tuple[int, ...] = ()
    cache_length: Optional[int] = None
    intermediates: bool = False
    score_gain: float = 1.0               # multiplies query/key kernels (large scores)
    #: Compare the output (and gradients) only, and store only what is compared: the long
    #: cases, where the (B, N, T, S) arrays would dominate the fixtures and ``"auto"`` takes
    #: the CPU fast paths only when no attention scores are asked for.
    compact: bool = False


# ---------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------

OFF = dict(pre_compose=False, post_compose=False)
STATIC_ONLY = dict(static_compose=True, dynamic_projection=False, dynamic_gating=False)
ALL_SWITCHES = dict(num_heads=4, num_key_value_heads=2, num_groups=2, static_compose=True,
                    qk_norm=True, rope_max_wavelength=100.0, use_bias=True, sliding_window=5)
LLM = dict(qk_norm=True, rope_max_wavelength=1000.0, num_key_value_heads=2, sliding_window=3)
CROSS = dict(cross_attention=True)
CROSS_DIMS = dict(query_length=6, key_length=10, query_input_dim=12, key_input_dim=8,
                  output_dim=12)


def _forward_cases() -> List[Spec]:
    c = []
    add = lambda *a, **k: c.append(Spec(*a, **k))  # noqa: E731
    # the composition switches, alone and together
    add("mha", "Plain multi-head attention: both compose stages off.", config=OFF)
    add("talking_heads", "Talking-Heads attention: static compose only, pre and post.",
        config=STATIC_ONLY)
    add("talking_heads_pre_only", "Static compose on the scores only (post stage off).",
        config=dict(STATIC_ONLY, post_compose=False))
    add("dcmha", "DCMHA defaults: dynamic projection and gating, query- and key-wise, pre and post.")
    add("dcmha_static", "DCMHA dynamic weights plus static compose.", config=dict(static_compose=True))
    add("pre_compose_only", "Only the pre-softmax compose (on scores).", config=dict(post_compose=False))
    add("post_compose_only", "Only the post-softmax compose (on probabilities).",
        config=dict(pre_compose=False))
    add("query_wise_only", "Query-wise composition only (projection and gating; key_wise off).",
        config=dict(key_wise=False))
    add("key_wise_only", "Key-wise composition only (projection and gating; query_wise off).",
        config=dict(query_wise=False))
    add("dynamic_projection_only", "Dynamic low-rank projection only (gating off).",
        config=dict(dynamic_gating=False))
    add("dynamic_gating_only", "Dynamic gating only (projection off).",
        config=dict(dynamic_projection=False))
    add("all_switches", "Every switch on: static+dynamic compose, QK-norm, RoPE, bias, GQA, G=2, "
        "causal sliding window.", config=ALL_SWITCHES, causal=True)
    # groups, rank, hidden width, head layouts
    add("groups_2", "Two composition groups (G=2, M=2).", config=dict(num_groups=2))
    add("groups_4", "Four composition groups (N=8, G=4, M=2).",
        config=dict(num_heads=8, key_dim=4, num_groups=4))
    add("rank_1", "Dynamic projection rank R=1.", config=dict(rank=1))
    add("rank_3", "Dynamic projection rank R=3.", config=dict(rank=3))
    add("hidden_dim_5", "Dynamic hidden width K=5 instead of 2*R*M.", config=dict(dynamic_hidden_dim=5))
    add("gqa", "Grouped-query attention: N=4 query heads on N_kv=2 key/value heads.",
        config=dict(num_key_value_heads=2), causal=True)
    add("mqa", "Multi-query attention: N_kv=1.", config=dict(num_key_value_heads=1))
    add("value_dim_output_dim", "value_dim 4 != key_dim 8 and output width 10 != input width 12.",
        config=dict(value_dim=4), dims=dict(output_dim=10))
    add("gelu_exact", "Exact (erf) GELU in the dynamic projection.", config=dict(gelu_approximate=False))
    add("use_bias", "Projection biases on (non-zero).", config=dict(use_bias=True))
    add("qk_norm", "QK-norm with learned scales.", config=dict(qk_norm=True))
    add("rope", "Rotary embeddings (rotate-half), causal.", config=dict(rope_max_wavelength=100.0),
        causal=True)
    add("llm_layer", "QK-norm + RoPE + GQA + causal sliding window 3, as in a DCFormer++ local layer.",
        config=LLM, causal=True)
    # lengths and inputs
    add("key_length_differs", "Separate key/value inputs with S=11 != T=5 (self-attention weights).",
        dims=dict(query_length=5, key_length=11), self_attention=False)
    add("query_length_1", "A single query (T=1) against S=9 keys.",
        dims=dict(query_length=1, key_length=9), self_attention=False)
    add("cross_attention", "Cross-attention: separate query_*/key_* dynamic projections, "
        "D_q=12, D_kv=8, T=6, S=10.", config=CROSS, dims=CROSS_DIMS, self_attention=False)
    add("cross_attention_masked", "Cross-attention with GQA, static compose and a padding mask.",
        config=dict(CROSS, num_key_value_heads=2, static_compose=True), dims=CROSS_DIMS,
        self_attention=False, mask="padding")
    # masks
    add("causal", "Causal mask (s <= t).", causal=True)
    add("padding_mask", "Key padding mask (batch 1 has 3 padded keys).", mask="padding")
    add("padding_mask_causal", "Key padding mask combined with the causal mask.", mask="padding",
        causal=True)
    add("random_mask", "A random boolean attention mask (about 70% allowed).", mask="random")
    add("fully_masked_rows", "Some query rows have no allowed key: their output must be exactly 0.",
        mask="fully_masked", causal=True)
    add("sliding_window_causal", "Causal sliding window W=3: t-3 < s <= t.",
        config=dict(sliding_window=3), causal=True)
    add("sliding_window_bidirectional", "Sliding window W=3 without the causal mask: |t-s| < 3.",
        config=dict(sliding_window=3))
    add("large_scores", "Scores of magnitude ~30 (query/key kernels x3.5): a stable softmax is needed.",
        score_gain=3.5, causal=True)
    add("large_scores_mha", "Large-magnitude scores without compose (plain softmax stability).",
        config=OFF, score_gain=3.5)
    # chunking
    add("chunked", "query_chunk_size=3 (T=8): equals the unchunked forward; causal window 5.",
        config=dict(query_chunk_size=3, sliding_window=5, static_compose=True), causal=True)
    add("chunked_size_1", "query_chunk_size=1 with cross-attention and a padding mask.",
        config=dict(CROSS, query_chunk_size=1), dims=CROSS_DIMS, self_attention=False,
        mask="padding")
    # low precision (inputs and parameters exactly representable in the dtype)
    for dt in ("float16", "bfloat16"):
        add(f"mha_{dt}", f"Plain MHA with {dt} inputs.", dtype=dt, config=OFF)
        add(f"dcmha_{dt}", f"DCMHA defaults with {dt} inputs.", dtype=dt, causal=True)
        add(f"all_switches_{dt}", f"Every switch on, {dt} inputs.", dtype=dt, config=ALL_SWITCHES,
            causal=True)
        add(f"fully_masked_rows_{dt}", f"Fully masked rows, {dt} inputs.", dtype=dt,
            mask="fully_masked", causal=True, config=dict(static_compose=True))
    add("talking_heads_float16", "Talking-Heads with float16 inputs.", dtype="float16",
        config=STATIC_ONLY)
    add("cross_attention_bfloat16", "Cross-attention with a padding mask, bfloat16 inputs.",
        dtype="bfloat16", config=CROSS, dims=CROSS_DIMS, self_attention=False, mask="padding")
    # intermediates: scores, pre_composed, probs and the dynamic weights are compared too
    add("intermediates_dcmha", "Intermediates of DCMHA with static compose.",
        config=dict(static_compose=True), intermediates=True)
    add("intermediates_cross_attention", "Intermediates of masked cross-attention.",
        config=CROSS, dims=CROSS_DIMS, self_attention=False, mask="padding", intermediates=True)
    add("intermediates_gqa_window", "Intermediates with GQA, G=2 and a causal sliding window.",
        config=dict(num_key_value_heads=2, num_groups=2, sliding_window=4), causal=True,
        intermediates=True)
    add("intermediates_float16", "Intermediates of DCMHA with float16 inputs.", dtype="float16",
        causal=True, intermediates=True)
    return c


#: The long cases: T * S >= LONG_LENGTH_PRODUCT, the size from which ``"auto"`` takes the CPU
#: fast paths (torch, jax_cpu, tf_cpu); one batch, small widths, float32.
LONG_DIMS = dict(batch=1, query_length=96, key_length=96)
LONG_CROSS_DIMS = dict(batch=2, query_length=64, key_length=160, query_input_dim=12,
                       key_input_dim=8, output_dim=12)
LONG_ALL_SWITCHES = dict(ALL_SWITCHES, sliding_window=40, query_chunk_size=32)


def _long_cases() -> List[Spec]:
    c = []
    add = lambda *a, **k: c.append(Spec(*a, compact=True, **k))  # noqa: E731
    for kind, prefix in (("forward", "long"), ("gradients", "grad_long")):
        add(f"{prefix}_dcmha_causal", "T = S = 96 (past the CPU paths' threshold): DCMHA "
            "defaults, causal.", kind=kind, dims=LONG_DIMS, causal=True)
        add(f"{prefix}_all_switches", "T = S = 96: every switch on, causal sliding window 40, "
            "query chunks of 32 (key blocks skipped).", kind=kind, config=LONG_ALL_SWITCHES,
            dims=LONG_DIMS, causal=True)
    add("long_window_bidirectional", "T = S = 96: sliding window 24 without the causal mask, "
        "static compose.", config=dict(sliding_window=24, static_compose=True), dims=LONG_DIMS)
    add("long_cross_attention_masked", "T = 64, S = 160: masked cross-attention with GQA.",
        config=dict(CROSS, num_key_value_heads=2), dims=LONG_CROSS_DIMS, self_attention=False,
        mask="padding")
    return c


def _decode_cases() -> List[Spec]:
    c = []
    add = lambda *a, **k: c.append(Spec(*a, kind="decode", causal=True, **k))  # noqa: E731
    add("decode_mha", "Decode, plain MHA: prefill 4 then 4 single tokens.", config=OFF,
        decode_steps=(4, 1, 1, 1, 1))
    add("decode_dcmha", "Decode, DCMHA defaults: prefill 3 then 5 single tokens.",
        decode_steps=(3, 1, 1, 1, 1, 1))
    add("decode_single_tokens", "Decode one token at a time from position 0 (static + dynamic).",
        config=dict(static_compose=True), decode_steps=(1,) * 8)
    add("decode_multi_token_steps", "Decode in steps of several tokens: 3, 2, 3.",
        decode_steps=(3, 2, 3))
    add("decode_llm_layer", "Decode with QK-norm, RoPE, GQA and sliding window 3.", config=LLM,
        decode_steps=(4, 1, 1, 1, 1))
    add("decode_all_switches", "Decode with every switch on (MQA, G=2, bias, static, window).",
        config=dict(ALL_SWITCHES, num_key_value_heads=1), decode_steps=(2, 2, 1, 1, 1, 1))
    add("decode_cache_longer", "Decode into a cache of 11 positions with 8 tokens (tail unwritten).",
        decode_steps=(5, 1, 1, 1), cache_length=11)
    add("decode_float16", "Decode, DCMHA defaults, float16 inputs.", dtype="float16",
        decode_steps=(4, 1, 1, 1, 1))
    add("decode_bfloat16", "Decode with QK-norm, RoPE and GQA, bfloat16 inputs.", dtype="bfloat16",
        config=LLM, decode_steps=(4, 2, 1, 1))
    return c


def _gradient_cases() -> List[Spec]:
    c = []
    add = lambda *a, **k: c.append(Spec(*a, kind="gradients", **k))  # noqa: E731
    add("grad_mha", "Gradients of plain MHA (biases on).", config=dict(OFF, use_bias=True))
    add("grad_talking_heads", "Gradients of Talking-Heads (static compose only).", config=STATIC_ONLY)
    add("grad_dcmha", "Gradients of DCMHA defaults.", causal=True)
    add("grad_pre_compose_only", "Gradients with only the pre-softmax compose.",
        config=dict(post_compose=False))
    add("grad_post_compose_only", "Gradients with only the post-softmax compose.",
        config=dict(pre_compose=False))
    add("grad_query_wise_only", "Gradients, query-wise composition only (key_wise off).",
        config=dict(key_wise=False))
    add("grad_key_wise_only", "Gradients, key-wise composition only (query_wise off).",
        config=dict(query_wise=False))
    add("grad_dynamic_projection_only", "Gradients, dynamic projection without gating.",
        config=dict(dynamic_gating=False))
    add("grad_dynamic_gating_only", "Gradients, dynamic gating without projection.",
        config=dict(dynamic_projection=False))
    add("grad_all_switches", "Gradients with every switch on (QK-norm, RoPE, bias, GQA, G=2, "
        "static, causal window).", config=ALL_SWITCHES, causal=True)
    add("grad_groups_rank", "Gradients with G=2, R=1, K=5 and exact GELU.",
        config=dict(num_groups=2, rank=1, dynamic_hidden_dim=5, gelu_approximate=False))
    add("grad_cross_attention", "Gradients of masked cross-attention (query, key and value inputs).",
        config=CROSS, dims=CROSS_DIMS, self_attention=False, mask="padding")
    add("grad_key_length_differs", "Gradients with separate key/value inputs, T=5, S=11.",
        dims=dict(query_length=5, key_length=11), self_attention=False)
    add("grad_fully_masked_rows", "Gradients with fully masked rows (no NaN, zero contribution).",
        mask="fully_masked", causal=True)
    add("grad_dcmha_float16", "Gradients of DCMHA defaults with float16 inputs.", dtype="float16",
        causal=True)
    return c


def all_specs(gradients: bool = True) -> List[Spec]:
    specs = _forward_cases() + _decode_cases() + (_gradient_cases() if gradients else [])
    specs += [x for x in _long_cases() if gradients or x.kind != "gradients"]
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise AssertionError(f"duplicate case names: {dup}")
    return specs


# ---------------------------------------------------------------------------
# Building one case
# ---------------------------------------------------------------------------

def _attention_mask(kind: Optional[str], B: int, T: int, S: int, rng) -> Optional[np.ndarray]:
    if kind is None:
        return None
    valid = np.array([S, S - 3])[np.arange(B) % 2]
    mask = np.broadcast_to(np.arange(S)[None, None, :] < valid[:, None, None], (B, T, S)).copy()
    if kind == "random":
        mask = rng.random((B, T, S)) < 0.7
    elif kind == "fully_masked":
        mask[0, min(2, T - 1), :] = False
        mask[B - 1, T - 1, :] = False
    elif kind != "padding":
        raise ValueError(f"unknown mask kind {kind!r}")
    return mask


def _params(spec: Spec, cfg: ref.Config, dims: dict, rng) -> Dict[str, np.ndarray]:
    p = ref.init_params(cfg, dims["query_input_dim"], dims["key_input_dim"], dims["output_dim"],
                        rng=rng)
    for name in sorted(p):
        base = name.split("_")[-1] if not name.startswith("static_") else "static"
        if base in GAINS:
            p[name] = p[name] * GAINS[base]
        elif name.endswith("_bias"):
            p[name] = rng.normal(0.0, 0.5, size=p[name].shape)
        elif name.endswith("norm_scale"):
            p[name] = rng.uniform(0.5, 1.5, size=p[name].shape)
    if spec.score_gain != 1.0:
        p["query_kernel"] = p["query_kernel"] * spec.score_gain
        p["key_kernel"] = p["key_kernel"] * spec.score_gain
    return {n: tol.round_to_dtype(v, spec.dtype) for n, v in p.items()}


def _relative_change(new: np.ndarray, old: np.ndarray, mask: np.ndarray) -> float:
    m = np.broadcast_to(mask[:, None], old.shape)
    scale = np.max(np.abs(old[m])) if m.any() else 0.0
    return float(np.max(np.abs(new - old)[m]) / scale) if scale else 0.0


def _decode(params, cfg: ref.Config, query: np.ndarray, steps, cache_length: int) -> np.ndarray:
    cache = ref.init_cache(cfg, query.shape[0], cache_length)
    outs, i = [], 0
    for n in steps:
        y, cache = ref.decode_step(params, cfg, query[:, i:i + n], cache, i)
        outs.append(y)
        i += n
    return np.concatenate(outs, axis=1)


def _snap(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """float32 copies with float64 rounding noise (|x| < 1e-12 of the kind's max) set to 0.

    Values that are 0 in exact arithmetic (e.g. a key-bias gradient without compose) come out
    of float64 as ~1e-17 noise that may differ between machines; zeroing it keeps the files
    byte-reproducible and the expectation exact.
    """
    largest: Dict[str, float] = {}
    for n, a in arrays.items():
        largest[tol.kind_of(n)] = max(largest.get(tol.kind_of(n), 0.0), float(np.max(np.abs(a))))
    return {n: np.where(np.abs(a) < 1e-12 * largest[tol.kind_of(n)], 0.0, a).astype(np.float32)
            for n, a in arrays.items()}


def build(spec: Spec) -> Tuple[dict, Dict[str, np.ndarray]]:
    """(case JSON dict, npz arrays) of one case."""
    rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
    cfg = ref.Config(**{**BASE_CONFIG, **spec.config}).validate()
    dims = {**BASE_DIMS, **spec.dims}
    dims.setdefault("output_dim", dims["query_input_dim"])
    B, T, S = dims["batch"], dims["query_length"], dims["key_length"]
    if spec.self_attention and (T != S or dims["query_input_dim"] != dims["key_input_dim"]):
        raise AssertionError(f"{spec.name}: self-attention needs T == S and D_q == D_kv")
    params = _params(spec, cfg, dims, rng)
    arrays: Dict[str, np.ndarray] = {f"param/{n}": v for n, v in params.items()}

    rnd = lambda *shape: tol.round_to_dtype(rng.normal(size=shape), spec.dtype)  # noqa: E731
    query = rnd(B, T, dims["query_input_dim"])
    key = value = None
    arrays["input/query"] = query
    if not spec.self_attention:
        key = rnd(B, S, dims["key_input_dim"])
        value = rnd(B, S, dims["key_input_dim"])
        arrays["input/key"], arrays["input/value"] = key, value
    mask = _attention_mask(spec.mask, B, T, S, rng)
    if mask is not None:
        arrays["input/attention_mask"] = mask
    call_kw = dict(attention_mask=mask, use_causal_mask=spec.causal)

    y, inter = ref.attention(params, cfg, query, key, value, return_intermediates=True, **call_kw)
    expected = {"output": y, "attention_scores": inter["post_composed"],
                "scores": inter["scores"], "pre_composed": inter["pre_composed"],
                "probs": inter["probs"]}
    for side in ("query_dynamic", "key_dynamic"):
        for slot, ws in inter[side].items():
            for w, a in ws.items():
                expected[f"dynamic/{slot}/{w}"] = a
    full_mask = inter["mask"]
    _check_case(spec, cfg, params, query, key, value, call_kw, expected, full_mask)

    if spec.kind == "decode":
        if sum(spec.decode_steps) != T or not spec.causal or not spec.self_attention:
            raise AssertionError(f"{spec.name}: decode needs causal self-attention over sum(steps)")
        dec = _decode(params, cfg, query, spec.decode_steps, spec.cache_length or T)
        err = float(np.max(np.abs(dec - y)))
        if err > INVARIANCE_ATOL:
            raise AssertionError(f"{spec.name}: decode differs from the full forward by {err:.3g}")
    if spec.kind == "gradients":
        from dcmha.spec.reference_grad import attention_grads

        d_output = rnd(B, T, dims["output_dim"])
        arrays["input/d_output"] = d_output
        grads = attention_grads(params, cfg, query, key, value, d_output=d_output, **call_kw)
        for n, g in grads.items():
            expected[f"grad/{n}"] = g

    if spec.kind == "forward" and spec.compact:
        outputs = ["output"]
    elif spec.kind == "forward":
        outputs = ["output", "attention_scores"]
        if spec.intermediates:
            outputs += ["scores", "pre_composed", "probs"] + sorted(
                n for n in expected if n.startswith("dynamic/"))
    elif spec.kind == "decode":
        outputs = ["output"]
    else:
        inputs = ["query"] + ([] if spec.self_attention else ["key", "value"])
        outputs = ["output"] + [f"grad/{n}" for n in inputs] + [f"grad/{n}" for n in sorted(params)]
    requires = [{"forward": "forward", "decode": "decode", "gradients": "gradients"}[spec.kind],
                spec.dtype] + (["intermediates"] if spec.intermediates else [])
    if T * S >= LONG_LENGTH_PRODUCT:
        requires.append("long_sequences")

    stored = _snap(expected)
    arrays.update({f"expected/{n}": a for n, a in stored.items()
                   if not spec.compact or n in outputs})
    sigma = float(f"{tol.score_scale(stored['pre_composed'], full_mask):.6g}")
    call = {"use_causal_mask": spec.causal, "self_attention": spec.self_attention,
            "has_attention_mask": mask is not None}
    if spec.kind == "decode":
        call["decode_steps"] = list(spec.decode_steps)
        if spec.cache_length is not None:
            call["cache_length"] = spec.cache_length
    meta = {
        "name": spec.name, "description": spec.description, "spec_version": ref.SPEC_VERSION,
        "kind": spec.kind, "config": cfg.to_dict(), "dims": dims, "dtype": spec.dtype,
        "call": call, "requires": requires, "outputs": outputs,
        "tolerance": tol.case_tolerances(stored, outputs, spec.dtype, sigma),
        "score_scale": sigma, "tolerance_policy": TOLERANCE_POLICY,
    }
    return meta, arrays


def _check_case(spec, cfg, params, query, key, value, call_kw, expected, mask) -> None:
    """The invariants a case relies on; AssertionError naming the case otherwise."""
    for n, a in expected.items():
        if not np.all(np.isfinite(a)):
            raise AssertionError(f"{spec.name}: {n} is not finite")
    has_terms = bool(ref.slots(cfg)) or cfg.static_compose
    if cfg.pre_compose and has_terms:
        ch = _relative_change(expected["pre_composed"], expected["scores"], mask)
        if ch < MIN_COMPOSE_EFFECT:
            raise AssertionError(f"{spec.name}: pre-compose changes scores by only {ch:.3g}")
    if cfg.post_compose and has_terms:
        ch = _relative_change(expected["attention_scores"], expected["probs"], mask)
        if ch < MIN_COMPOSE_EFFECT:
            raise AssertionError(f"{spec.name}: post-compose changes probs by only {ch:.3g}")
    if spec.score_gain == 1.0 and np.max(np.abs(expected["pre_composed"])) > 20.0:
        raise AssertionError(f"{spec.name}: composed scores are not moderate")
    if spec.score_gain > 1.0 and np.max(np.abs(expected["pre_composed"])) < 25.0:
        raise AssertionError(f"{spec.name}: large-magnitude case has small scores")
    if spec.mask == "fully_masked":
        rows = ~mask.any(axis=-1)
        if not rows.any() or (not cfg.use_bias and np.any(expected["output"][rows] != 0.0)):
            raise AssertionError(f"{spec.name}: fully masked rows must exist and output 0")
    if cfg.query_chunk_size is not None:
        full = ref.attention(params, dataclasses.replace(cfg, query_chunk_size=None), query, key,
                             value, **call_kw)
        err = float(np.max(np.abs(full - expected["output"])))
        if err > INVARIANCE_ATOL:
            raise AssertionError(f"{spec.name}: chunked differs from unchunked by {err:.3g}")


# ---------------------------------------------------------------------------
# Byte-reproducible writers
# ---------------------------------------------------------------------------

def npy_bytes(array: np.ndarray) -> bytes:
    """A version-1.0 .npy file of ``array`` with a header independent of the NumPy version."""
    array = np.ascontiguousarray(array)
    header = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (
        np.lib.format.dtype_to_descr(array.dtype), tuple(int(n) for n in array.shape))
    header += " " * ((-(10 + len(header) + 1)) % 64) + "\n"
    return (b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1")
            + array.tobytes())


def npz_bytes(arrays: Dict[str, np.ndarray]) -> bytes:
    """An uncompressed .npz (zip) with sorted members and fixed timestamps and attributes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3
            info.external_attr = 0o644 << 16
            zf.writestr(info, npy_bytes(arrays[name]))
    return buf.getvalue()


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


def generate(out_dir: Path, gradients: bool = True, pattern: Optional[str] = None) -> Dict[str, str]:
    """Write every case (or those matching ``pattern``) and MANIFEST.json; returns the manifest files.

    Writing the whole set (no pattern) removes stale .json/.npz files from ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: Dict[str, bytes] = {}
    for spec in all_specs(gradients):
        if pattern and not fnmatch.fnmatchcase(spec.name, pattern):
            continue
        meta, arrays = build(spec)
        files[f"{spec.name}.json"] = json_bytes(meta)
        files[f"{spec.name}.npz"] = npz_bytes(arrays)
    if pattern is None:
        for old in list(out_dir.glob("*.json")) + list(out_dir.glob("*.npz")):
            if old.name not in files and old.name != MANIFEST_NAME:
                old.unlink()
    for name, data in files.items():
        (out_dir / name).write_bytes(data)
    manifest = {"spec_version": ref.SPEC_VERSION, "generator": "python -m dcmha.conformance.generate",
                "files": {n: hashlib.sha256(d).hexdigest() for n, d in sorted(files.items())}}
    (out_dir / MANIFEST_NAME).write_bytes(json_bytes(manifest))
    return manifest["files"]


def compare_dirs(a: Path, b: Path) -> List[str]:
    """Names of files that differ between two fixture directories (missing counts as differing)."""
    names = {p.name for p in Path(a).iterdir()} | {p.name for p in Path(b).iterdir()}
    return sorted(n for n in names
                  if not ((Path(a) / n).is_file() and (Path(b) / n).is_file()
                          and (Path(a) / n).read_bytes() == (Path(b) / n).read_bytes()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcmha.conformance.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=FIXTURES_DIR, help="output directory")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and compare with --out byte for byte")
    ap.add_argument("--no-gradients", action="store_true",
                    help="leave out the gradient cases (they need dcmha.spec.reference_grad)")
    args = ap.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp), gradients=not args.no_gradients)
            diff = compare_dirs(Path(tmp), args.out)
        if diff:
            print(f"{len(diff)} fixture files differ from a fresh generation: {', '.join(diff)}")
            return 1
        print(f"fixtures in {args.out} reproduce byte for byte")
        return 0
    files = generate(args.out, gradients=not args.no_gradients)
    size = sum((args.out / n).stat().st_size for n in files)
    print(f"wrote {len(files) // 2} cases ({len(files)} files, {size / 1e6:.2f} MB) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
