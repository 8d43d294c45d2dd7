"""Packaging glue: the one import package ``dcmha`` is assembled from top-level folders.

pyproject.toml holds the metadata; this maps the folders onto ``dcmha`` and finds every
sub-package (a folder with an ``__init__.py``), so adding one needs no edit here.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"dcmha": "dcmha_core", "dcmha.spec": "spec", "dcmha.backends": "backends",
         "dcmha.export": "export", "dcmha.conformance": "conformance"}


def _packages():
    here = Path(__file__).parent
    found = []
    for name, folder in ROOTS.items():
        for init in sorted((here / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(here / folder).parts
            found.append(".".join((name,) + rel))
    return found


setup(package_dir=ROOTS, packages=_packages())
