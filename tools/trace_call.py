"""Which of dcmha's files one eager call of a DCMHA layer runs code in.

Builds a small DCMHA (composition on: self-attention, causal mask), runs one call to
warm it up, then traces a second call with ``sys.setprofile`` and prints, for each
implementation asked for, the package files whose functions ran (paths relative to
the repository, in the order first entered) and their count. Keras's and the
frameworks' own files are not counted.

    KERAS_BACKEND=jax python tools/trace_call.py                  # "ops" and "auto"
    KERAS_BACKEND=torch python tools/trace_call.py --implementation ops
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_dir():
    """The folder of the imported ``dcmha`` package."""
    import dcmha
    return os.path.dirname(os.path.abspath(dcmha.__file__))


def package_roots():
    """The folders whose files are dcmha's (the installed package and the source tree)."""
    return tuple(sorted(r + os.sep for r in {package_dir(), ROOT}))


def traced_files(layer, x, **kwargs):
    """The package files whose code runs in ``layer(x, x, **kwargs)``, in first-entered order."""
    roots = package_roots()
    package = package_dir() + os.sep
    # The interpreter's own tree (a virtual environment may sit inside the checkout,
    # as CI's does) holds Keras and the frameworks, not dcmha: only the installed
    # package itself counts from there.
    skip = (os.path.abspath(__file__),
            *{os.path.abspath(p) + os.sep for p in (sys.prefix, sys.exec_prefix)})
    seen = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path not in seen:
            seen[path] = None

    sys.setprofile(profile)
    try:
        layer(x, x, **kwargs)
    finally:
        sys.setprofile(None)
    out = []
    for path in seen:
        path = os.path.abspath(path)
        if (os.path.isfile(path) and path.startswith(roots)
                and (path.startswith(package) or not path.startswith(skip))):
            out.append(_readable(path))
    return list(dict.fromkeys(out))


def _readable(path):
    """A path as the package names it (dcmha/...) where it is the installed package."""
    pkg = package_dir()
    if path.startswith(pkg + os.sep):
        return "dcmha/" + os.path.relpath(path, pkg)
    return os.path.relpath(path, ROOT)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--implementation", action="append", choices=("ops", "auto"),
                        help="the core(s) to trace (default: ops and auto)")
    args = parser.parse_args(argv)
    import numpy as np
    import keras
    from dcmha.layers import DCMHA

    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype("float32")
    for implementation in args.implementation or ("ops", "auto"):
        layer = DCMHA(num_heads=4, key_dim=4, seed=0, implementation=implementation)
        layer(x, x, use_causal_mask=True)                  # build and warm up
        files = traced_files(layer, x, use_causal_mask=True)
        print(f"{keras.backend.backend()} implementation={implementation!r}: "
              f"{len(files)} files")
        for f in files:
            print("   ", f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
