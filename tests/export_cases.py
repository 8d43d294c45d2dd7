"""What the ONNX export tests share: the closeness check of a graph's output against the
float64 spec (``spec/reference.py``)."""

import numpy as np


def close(got, want, rel):
    """|got - want| <= rel * max(1, max|want|) elementwise, and no NaN."""
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any()
    bound = rel * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"
