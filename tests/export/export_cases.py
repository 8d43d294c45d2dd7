"""What the ONNX export tests share: the closeness check of a graph's output against the
float64 spec (``spec/reference.py``), and a catalogue of exported graphs whose digests show
that an exporter change which should not change any graph changes none.

    python tests/export/export_cases.py digests OUT.json [--export-dir DIR] [--keras]
    python tests/export/export_cases.py compare A.json B.json

``digests`` writes the SHA-256 of every catalogued ModelProto (serialized; or of the error
message where the exporter refuses the case), exported by the ``dcmha.export`` package of
this checkout or, with ``--export-dir``, by another copy of it (e.g. ``git archive`` of an
older commit's ``export/``); ``--keras`` adds Keras layer and model exports (set
``KERAS_BACKEND``). ``compare`` lists the cases whose digests differ and exits 1 if any do.
"""

import hashlib
import itertools
import json
import sys

import numpy as np


def close(got, want, rel):
    """|got - want| <= rel * max(1, max|want|) elementwise, and no NaN."""
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any()
    bound = rel * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


#: Layer configurations (spec ``Config`` keyword arguments) that the export tests share.
CONFIGS = {
    "dcmha": dict(num_heads=4, key_dim=4),
    "mha": dict(num_heads=4, key_dim=4, pre_compose=False, post_compose=False),
    "all_switches": dict(num_heads=4, key_dim=4, num_groups=2, num_key_value_heads=2, value_dim=3,
                         static_compose=True, qk_norm=True, rope_max_wavelength=50.0, use_bias=True,
                         sliding_window=3, dynamic_hidden_dim=5),
    "talking_heads": dict(num_heads=4, key_dim=4, static_compose=True, dynamic_projection=False,
                          dynamic_gating=False),
    "gating_only_post": dict(num_heads=4, key_dim=4, dynamic_projection=False, pre_compose=False),
    "projection_only_key_wise": dict(num_heads=6, key_dim=2, num_groups=3, dynamic_gating=False,
                                     query_wise=False, rank=1),
    "query_wise_pre_exact_gelu": dict(num_heads=4, key_dim=4, key_wise=False, post_compose=False,
                                      gelu_approximate=False),
    "gqa_mqa_window": dict(num_heads=4, key_dim=4, num_key_value_heads=1, sliding_window=2),
}

#: The configurations of the catalogue: ``CONFIGS`` and a few more.
CATALOGUE_CONFIGS = dict(
    CONFIGS,
    rope_gqa=dict(num_heads=4, key_dim=4, num_key_value_heads=2, rope_max_wavelength=50.0),
    window_chunk=dict(num_heads=4, key_dim=4, num_key_value_heads=1, sliding_window=2,
                      query_chunk_size=3),
    cross=dict(num_heads=4, key_dim=4, cross_attention=True, num_key_value_heads=2),
)

#: The calls of the catalogue (``CallSpec`` keyword arguments).
CATALOGUE_CALLS = {
    "self": dict(),
    "causal": dict(use_causal_mask=True),
    "causal_mask": dict(use_causal_mask=True, attention_mask=True),
    "mask_scores": dict(attention_mask=True, return_attention_scores=True),
    "general": dict(self_attention=False),
    "general_mask_causal": dict(self_attention=False, attention_mask=True, use_causal_mask=True),
    "decode": dict(decode=True),
    "decode_mask_scores": dict(decode=True, attention_mask=True, return_attention_scores=True),
    "intermediates": dict(intermediates=True, use_causal_mask=True),
}


def core_graphs(export_core):
    """{case name: ModelProto or the refusal's message} of ``export_core`` (the module
    ``dcmha.export.core``) over the catalogue, plus each kernel op's function."""
    from dcmha.spec import reference as ref

    out = {}
    for (cname, conf), (call_name, call), dtype, nodes, dynamic in itertools.product(
            CATALOGUE_CONFIGS.items(), CATALOGUE_CALLS.items(), ("float32", "float16"),
            (True, False), (True, False)):
        cfg = ref.Config(**conf)
        params = ref.init_params(cfg, 8, 6 if cfg.cross_attention else 8, 7,
                                 rng=np.random.default_rng(0))
        params = {n: v.astype(np.float32) for n, v in params.items()}
        name = f"core/{cname}/{call_name}/{dtype}/{'nodes' if nodes else 'plain'}/" \
               f"{'dynamic' if dynamic else 'static'}"
        try:
            out[name] = export_core.export_layer(
                cfg, params, export_core.CallSpec(**call), dtype=dtype, compose_nodes=nodes,
                dynamic=dynamic, dims=dict(batch=2, query_length=5, key_length=4, cache_length=9))
        except (ValueError, TypeError, NotImplementedError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    for op in export_core.KERNEL_OPS:
        out[f"kernel/{op}"] = export_core.kernel_function(op)
    return out


def rich_layer(width=8):
    """A built self-attention DCMHA layer with every switch on, input width ``width``."""
    from dcmha.layers import DCMHA

    layer = DCMHA(4, 4, num_groups=2, qk_norm=True, rope_max_wavelength=100.0, use_bias=True,
                  sliding_window=3, static_compose=True, num_key_value_heads=2)
    # build() rather than an eager call: on jax the first eager call compiles op by op
    layer.build((None, None, width), (None, None, width))
    return layer


def functional_lm(vocab=20, width=8):
    """A small functional language model: Embedding, two blocks of RMSNormalization, causal
    DCMHA (one windowed), LayerNormalization, a GELU Dense pair (with Dropout and a
    keras.ops add), and a Dense head."""
    import keras

    from dcmha.layers import DCMHA

    ids = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(vocab, width, name="embed")(ids)
    for i, window in enumerate([3, None]):
        a = keras.layers.RMSNormalization(name=f"attention_norm_{i}")(h)
        a = DCMHA(4, 4, rope_max_wavelength=100.0, sliding_window=window, name=f"attention_{i}")(
            a, a, use_causal_mask=True)
        h = keras.layers.Add(name=f"residual_{i}")([h, a])
        f = keras.layers.LayerNormalization(name=f"ffn_norm_{i}")(h)
        f = keras.layers.Dense(2 * width, activation="gelu", name=f"up_{i}")(f)
        f = keras.layers.Dropout(0.1)(f)
        h = h + keras.layers.Dense(width, name=f"down_{i}")(f)      # a keras.ops node
    return keras.Model(ids, keras.layers.Dense(vocab, name="logits")(h), name="lm")


def keras_graphs(keras_export):
    """{case name: ModelProto or the refusal's message} of ``keras_export`` (the module
    ``dcmha.export.keras_export``) on a DCMHA layer and a small functional language model."""
    import keras

    keras.utils.set_random_seed(0)
    layer = rich_layer()
    lm = functional_lm()
    out = {}
    for dtype, decode, nodes in itertools.product(("float32", "float16"), (False, True),
                                                  (True, False)):
        tag = f"{dtype}/{'decode' if decode else 'forward'}/{'nodes' if nodes else 'plain'}"
        kinds = {"layer": (layer, dict(use_causal_mask=True, attention_mask=not decode,
                                       return_attention_scores=not decode)),
                 "lm": (lm, {})}
        for kind, (obj, extra) in kinds.items():
            try:
                out[f"keras/{kind}/{tag}"] = keras_export.build(
                    obj, dtype=dtype, decode=decode, compose_nodes=nodes, **extra)
            except (ValueError, TypeError) as err:
                out[f"keras/{kind}/{tag}"] = f"{type(err).__name__}: {err}"
    return out


def digests(graphs):
    """{case: SHA-256 of the serialized ModelProto / FunctionProto, or of the message}."""
    return {name: hashlib.sha256(g.encode() if isinstance(g, str) else g.SerializeToString(
        deterministic=True)).hexdigest() for name, g in graphs.items()}


def _load_export(directory):
    """The package ``dcmha.export`` loaded from ``directory`` instead of this checkout."""
    import importlib.util
    import os

    import dcmha  # noqa: F401  (the parent package, from this checkout)
    spec = importlib.util.spec_from_file_location(
        "dcmha.export", os.path.join(directory, "__init__.py"),
        submodule_search_locations=[directory])
    module = importlib.util.module_from_spec(spec)
    sys.modules["dcmha.export"] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("digests")
    d.add_argument("out")
    d.add_argument("--export-dir", default=None)
    d.add_argument("--keras", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.command == "digests":
        if args.export_dir:
            _load_export(args.export_dir)
        import importlib

        graphs = core_graphs(importlib.import_module("dcmha.export.core"))
        if args.keras:
            graphs.update(keras_graphs(importlib.import_module("dcmha.export.keras_export")))
        with open(args.out, "w") as f:
            json.dump(digests(graphs), f, indent=1, sort_keys=True)
        print(f"{len(graphs)} graphs from {sys.modules['dcmha.export'].__file__}")
        return 0
    with open(args.a) as f:
        a = json.load(f)
    with open(args.b) as f:
        b = json.load(f)
    differ = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
    for n in differ:
        print("differs:", n)
    print(f"{len(set(a) | set(b)) - len(differ)} identical, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
