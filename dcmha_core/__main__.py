"""Command line: ``python -m dcmha demo [--steps N] [--backend B] [--output DIR] ...``.

The Keras backend is fixed when Keras is first imported, so ``--backend`` is
read and put into ``KERAS_BACKEND`` before anything imports Keras.
"""

import os
import sys

USAGE = """usage: python -m dcmha COMMAND [options]

commands:
  demo    train a byte-level DCFormer and a Transformer++ on the Python standard
          library's sources, compare them, export to ONNX, sample
          (python -m dcmha demo --help)"""


def _backend_from_argv(argv):
    for i, a in enumerate(argv):
        if a == "--backend" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--backend="):
            return a.split("=", 1)[1]
    return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "demo":
        print(f"Unknown command {command!r}.\n{USAGE}", file=sys.stderr)
        return 2
    backend = _backend_from_argv(rest)
    if backend:
        os.environ["KERAS_BACKEND"] = backend     # before any Keras import
    from dcmha import demo
    return demo.main(rest)


if __name__ == "__main__":
    sys.exit(main())
