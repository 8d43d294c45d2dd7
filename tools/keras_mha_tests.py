"""Keras's own MultiHeadAttention tests, run against DCMHA with composition off.

Runs ``keras/src/layers/attention/multi_head_attention_test.py`` from the installed
Keras with ``layers.MultiHeadAttention`` in that module replaced by a DCMHA subclass
whose defaults are MultiHeadAttention's: ``pre_compose=False, post_compose=False``
(plain multi-head attention) and ``use_bias=True`` (DCMHA's default is the paper's
False, docs/differences-from-mha.md). Every other name the tests read from
``keras.src.layers`` is Keras's own. Prints each failed test and the count passed.

    KERAS_BACKEND=jax python tools/keras_mha_tests.py [pytest arguments, e.g. -k mask]

The exit status is pytest's (0 when every test passed).
"""

from __future__ import annotations

import os
import sys
import types


def _test_file():
    import keras
    path = os.path.join(os.path.dirname(keras.__file__), "src", "layers", "attention",
                        "multi_head_attention_test.py")
    if not os.path.isfile(path):
        raise SystemExit(f"The installed Keras ({keras.__version__}) does not ship {path}.")
    return path


def dcmha_as_mha():
    """A DCMHA subclass with MultiHeadAttention's defaults, registered for saving."""
    import keras
    from dcmha.layers import DCMHA

    @keras.saving.register_keras_serializable(package="dcmha_keras_mha_tests")
    class MultiHeadAttention(DCMHA):
        """DCMHA with composition off and MultiHeadAttention's ``use_bias=True``."""

        def __init__(self, num_heads, key_dim, value_dim=None, dropout=0.0, use_bias=True,
                     output_shape=None, attention_axes=None, pre_compose=False,
                     post_compose=False, **kwargs):
            super().__init__(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim,
                             dropout=dropout, use_bias=use_bias, output_shape=output_shape,
                             attention_axes=attention_axes, pre_compose=pre_compose,
                             post_compose=post_compose, **kwargs)

    return MultiHeadAttention


class _Substitute:
    """pytest plugin: swaps the test module's ``layers`` for one whose
    MultiHeadAttention is DCMHA, and records each test's outcome."""

    def __init__(self):
        self.outcomes = {}

    def pytest_collection_modifyitems(self, items):
        from keras.src import layers as keras_layers
        proxy = types.ModuleType("layers_with_dcmha")
        proxy.__dict__.update(vars(keras_layers))
        proxy.MultiHeadAttention = dcmha_as_mha()
        for module in {item.module for item in items if getattr(item, "module", None)}:
            if getattr(module, "layers", None) is keras_layers:
                module.layers = proxy

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            if report.nodeid not in self.outcomes or report.outcome != "passed":
                self.outcomes[report.nodeid] = report.outcome


def main(argv=None):
    import pytest
    plugin = _Substitute()
    args = [_test_file(), "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    status = pytest.main(args + list(argv if argv is not None else sys.argv[1:]),
                         plugins=[plugin])
    import keras
    failed = sorted(n for n, o in plugin.outcomes.items() if o == "failed")
    passed = sum(o == "passed" for o in plugin.outcomes.values())
    for name in failed:
        print("FAILED", name.split("::", 1)[-1])
    print(f"{keras.backend.backend()}: {passed}/{len(plugin.outcomes)} passed, "
          f"{len(failed)} failed")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
