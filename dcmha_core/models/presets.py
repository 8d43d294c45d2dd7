"""Preset configurations of `DCFormerLM.from_preset` (the table with parameter counts is in
its docstring)."""

__all__ = ["PRESETS"]

#: Heads of 16: in the quality study (benchmarks/RESULTS.md) DCMHA's gain over the same
#: model without composition grows as heads get smaller (heads of 32 lose at 2 x 64), and
#: heads of 16 are what it measured at 4 x 256. The larger presets keep the paper's shapes.
_TINY = dict(vocab_size=256, num_layers=4, hidden_dim=128, num_heads=8, sliding_window=64,
             window_pattern="LG", rope_max_wavelength=10000)
_405M = dict(vocab_size=50432, num_layers=24, hidden_dim=1024, num_heads=16,
             sliding_window=256, window_pattern="LG", rope_max_wavelength=10000)
#: Post-composition only: the attention probabilities are composed after the softmax,
#: the scores before it are not (pre_compose off): two of the four dynamic-weight slots
#: (post-query, post-key).
_POST_ONLY = dict(pre_compose=False, post_compose=True)

#: Preset configurations for `DCFormerLM.from_preset` (parameter counts there).
PRESETS = {
    "dcformer_tiny": _TINY,
    "dcformer_405m": _405M,
    "dcformer_2.8b": dict(vocab_size=50432, num_layers=32, hidden_dim=2560, num_heads=32,
                          sliding_window=256, window_pattern="LG", qk_norm=True,
                          rope_max_wavelength=10000),
    "dcformer_post_tiny": dict(_TINY, **_POST_ONLY),
    "dcformer_post_405m": dict(_405M, **_POST_ONLY),
}
