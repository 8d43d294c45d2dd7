"""An out-of-tree implementation, added the way a third-party package adds one, passes the
conformance suite: conformance/README.md's "Adding a fast path", end to end.

``tests/toy_impl`` is the package (``dcmha_toy``: an ``Implementation`` named "toy" on the
numpy Keras backend, which compiles nothing and keeps the test to seconds, whose ``attention``
runs dcmha's plain core) with its ``pyproject.toml``. Instead
of ``pip install -e tests/toy_impl`` (slow) the test puts the folder on ``PYTHONPATH``: it
holds the package and the ``dist-info`` an install would write (``entry_points.txt`` with the
``dcmha.implementations`` entry point), which importlib.metadata finds on ``sys.path``. No
file of dcmha names the toy: the registry finds it through the entry point, and the runner
makes it the adapter "impl-toy".
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcmha.conformance import load_cases

TOY = Path(__file__).resolve().parents[1] / "toy_impl"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TOY), env.get("PYTHONPATH")]))
    env.pop("KERAS_BACKEND", None)      # the runner gives each worker its backend
    return env


def test_toy_package_declares_the_entry_point_it_ships():
    """The dist-info on PYTHONPATH says what the package's pyproject.toml declares."""
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    declared = tomllib.loads((TOY / "pyproject.toml").read_text())
    (dist_info,) = TOY.glob("*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text().split()
    group = declared["project"]["entry-points"]["dcmha.implementations"]
    assert group == {"toy": "dcmha_toy:IMPLEMENTATION"}
    assert entry_points == ["[dcmha.implementations]", "toy", "=", "dcmha_toy:IMPLEMENTATION"]


def test_toy_implementation_passes_the_suite(tmp_path):
    report = tmp_path / "toy.json"
    r = subprocess.run([sys.executable, "-m", "dcmha.conformance", "--backend", "impl-toy",
                        "--json", str(report)], capture_output=True, text=True, env=_env(),
                       timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads(report.read_text())["results"]
    cases = {c.name: c for c in load_cases()}
    # The numpy backend has no gradients, and "auto" never takes the toy on a CPU (no
    # auto_devices), so the long cases, which exist to cross the CPU paths' size thresholds,
    # are not its; every other case passes, on every output.
    skipped = {n: [r for r in ("gradients", "long_sequences") if r in c.requires]
               for n, c in cases.items()}
    skipped = {n: lacks for n, lacks in skipped.items() if lacks}
    assert 0 < len(skipped) < len(cases) - 40
    assert {r["case"] for r in results} == set(cases)
    for res in results:
        lacks = skipped.get(res["case"])
        if lacks:
            them = "it" if len(lacks) == 1 else "them"
            assert (res["status"], res["reason"]) == (
                "SKIP", f"needs {', '.join(lacks)}; impl-toy lacks {them}"), res
        else:
            assert res["status"] == "PASS", res
            assert res["not_covered"] == [] and res["paths"] == ["toy"], res
    assert r.stdout.strip().splitlines()[-1] == (
        f"{len(cases) - len(skipped)} passed, 0 failed, {len(skipped)} skipped")
