"""`import dcmha` alone makes every dcmha class loadable by `keras.saving.load_model`.

Models are saved in this process and loaded in a fresh one that does nothing but
``import dcmha, keras`` (or ``import keras, dcmha``) before ``load_model``; the
loaded models must give this process's outputs (any Keras backend).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")

BACKEND = keras.backend.backend()

LOAD = """
import sys
{imports}
import numpy as np
folder, predict = sys.argv[1], sys.argv[2] == "predict"
lm = keras.saving.load_model(folder + "/lm.keras")
fn = keras.saving.load_model(folder + "/fn.keras")
out = dict(lm_class=type(lm).__name__, layers=[type(l).__name__ for l in fn.layers],
           torch_imported="torch" in sys.modules)
if predict:
    out.update(lm=lm.predict_on_batch(np.load(folder + "/ids.npy")),
               fn=fn.predict_on_batch(np.load(folder + "/x.npy")))
else:
    out.update({{f"w{{i}}": np.asarray(w) for i, w in enumerate(lm.get_weights() + fn.get_weights())}})
np.savez(folder + "/out_" + sys.argv[2] + ".npz", **{{k: np.asarray(v) for k, v in out.items()}})
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from dcmha.layers import DCMHA
    from dcmha.models import DCFormerLM

    folder = tmp_path_factory.mktemp("registration")
    keras.utils.set_random_seed(7)
    lm = DCFormerLM(vocab_size=24, num_layers=1, hidden_dim=8, num_heads=4, sliding_window=3,
                    window_pattern="LG", rope_max_wavelength=100.0)
    lm.build((None, None))
    x_in = keras.Input((None, 8))
    h = DCMHA(num_heads=2, key_dim=4, rank=1, static_compose=True)(x_in, x_in,
                                                                   use_causal_mask=True)
    fn = keras.Model(x_in, keras.layers.Dense(3)(h))
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 24, size=(2, 5)).astype("int32")
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    lm.save(folder / "lm.keras")
    fn.save(folder / "fn.keras")
    np.save(folder / "ids.npy", ids)
    np.save(folder / "x.npy", x)
    return dict(folder=folder, lm=np.asarray(lm.predict_on_batch(ids)),
                fn=np.asarray(fn.predict_on_batch(x)),
                weights=[np.asarray(w) for w in lm.get_weights() + fn.get_weights()])


# One order compares outputs, the other (cheaper: no compilation) the loaded weights.
@pytest.mark.parametrize("imports,check", [("import dcmha, keras", "predict"),
                                           ("import keras, dcmha", "weights")])
def test_import_dcmha_alone_registers(saved, imports, check):
    folder = saved["folder"]
    proc = subprocess.run([sys.executable, "-c", LOAD.format(imports=imports), str(folder), check],
                          env=dict(os.environ, KERAS_BACKEND=BACKEND), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(folder / f"out_{check}.npz")
    assert str(got["lm_class"]) == "DCFormerLM"
    assert "DCMHA" in [str(n) for n in got["layers"]]
    if check == "predict":
        np.testing.assert_allclose(got["lm"], saved["lm"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["fn"], saved["fn"], rtol=1e-6, atol=1e-6)
    else:
        assert len(saved["weights"]) == len([k for k in got.files if k.startswith("w")])
        for i, w in enumerate(saved["weights"]):
            np.testing.assert_array_equal(got[f"w{i}"], w)
    # Registration imports no framework beyond what the backend's Keras imports.
    if BACKEND != "torch":
        assert not bool(got["torch_imported"])


def test_import_dcmha_does_not_import_keras():
    code = "import sys, dcmha; print('keras' in sys.modules, 'jax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["False", "False"], proc.stderr


@pytest.mark.parametrize("first", ["import dcmha.layers", "import dcmha.models", "import dcmha.ops",
                                   "import dcmha.distribution", "import dcmha, keras",
                                   "import keras, dcmha"])
def test_every_import_order_registers_every_class(first):
    """Whichever of our modules is imported first (and so imports Keras half-way through
    its own import), registration completes once it is done, with no warning."""
    code = (f"{first}\n"
            "import keras, sys\n"
            "from keras.saving import get_registered_object as get\n"
            "names = ['DCMHA', 'DCFormerLM', 'DCFormerBlock', 'SwiGLU']\n"
            "missing = [n for n in names if get('dcmha>' + n) is None]\n"
            "hooks = [f for f in sys.meta_path if type(f).__module__ == 'dcmha']\n"
            "print(missing, len(hooks))\n")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, env=dict(os.environ), timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[] 0"
