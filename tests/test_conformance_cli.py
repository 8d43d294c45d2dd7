"""The conformance loader (checksums), the CLI (rows, closing line, exit codes, subprocess
workers, skips) and the generator's byte-for-byte reproducibility."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from dcmha.conformance import generate, load_cases
from dcmha.conformance.cases import FIXTURES_DIR, case_names, sha256_file
from dcmha.conformance.runner import import_failure, parse_adapter_specs
from dcmha.spec.reference import SPEC_VERSION

SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")

ADAPTERS = textwrap.dedent('''
    import os
    from dcmha.conformance.adapters.reference import ReferenceAdapter

    class Perturbed(ReferenceAdapter):
        """The reference with its output off by 1e-3 relative: a float32 bug, float16 noise."""
        name = "perturbed"

        def run(self, case):
            out = super().run(case)
            out["output"] = out["output"] * (1 + 1e-3)
            return out

    class ForwardOnly(ReferenceAdapter):
        name = "forward-only"
        capabilities = frozenset({"forward", "float32"})

    class Crashes(ReferenceAdapter):
        def run(self, case):
            os._exit(3)

    class MissingOutput(ReferenceAdapter):
        def run(self, case):
            out = super().run(case)
            out.pop("attention_scores", None)
            return out
''')


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    (d / "conformance_test_adapters.py").write_text(ADAPTERS)
    return d


def cli(*args, adapter_dir=None, env=None):
    e = dict(os.environ)
    if adapter_dir is not None:
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(adapter_dir), e.get("PYTHONPATH")]))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "dcmha.conformance", *args], capture_output=True,
                          text=True, env=e, timeout=600)


def rows(stdout):
    """{(backend, case): result column} of the table."""
    out = {}
    for line in stdout.splitlines()[1:-1]:
        backend, case, rest = line.split(None, 2)
        out[backend, case] = re.search(r"\b(PASS|FAIL|SKIP)\b.*$", rest).group(0)
    return out


# ---------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------

def test_fixture_set():
    cases = load_cases()
    names = [c.name for c in cases]
    assert len(cases) >= 40 and names == sorted(names)
    assert {c.kind for c in cases} == {"forward", "decode", "gradients"}
    assert {c.dtype for c in cases} == {"float32", "float16", "bfloat16"}
    assert sum(c.kind == "gradients" for c in cases) >= 12
    total = sum(p.stat().st_size for p in FIXTURES_DIR.iterdir())
    assert total < 3_000_000, total
    c = next(c for c in cases if c.name == "cross_attention")
    assert set(c.inputs) == {"query", "key", "value"}
    assert c.expected["output"].shape == (2, 6, 12) and c.cfg.cross_attention
    assert set(c.tolerance) == set(c.outputs) == {"output", "attention_scores"}
    assert [x.name for x in load_cases("grad_d*,mha")] == sorted(
        n for n in names if n.startswith("grad_d") or n == "mha")


@pytest.mark.parametrize("victim", ["dcmha.npz", "dcmha.json"])
def test_loader_refuses_corrupt_file(tmp_path, victim):
    fx = tmp_path / "fixtures"
    shutil.copytree(FIXTURES_DIR, fx)
    expected = sha256_file(fx / victim)
    data = bytearray((fx / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (fx / victim).write_bytes(bytes(data))
    received = sha256_file(fx / victim)
    with pytest.raises(ValueError) as err:
        load_cases(fixtures_dir=fx)
    msg = str(err.value)
    assert victim in msg and f"expected sha256 {expected}" in msg and f"received {received}" in msg
    assert len(load_cases("mha", fixtures_dir=fx)) == 1       # other cases still load
    r = cli("--fixtures", str(fx))
    assert r.returncode == 1 and victim in r.stderr


def test_loader_needs_manifest_and_matching_spec_version(tmp_path):
    with pytest.raises(ValueError, match="No MANIFEST.json"):
        load_cases(fixtures_dir=tmp_path)
    fx = tmp_path / "fixtures"
    shutil.copytree(FIXTURES_DIR, fx)
    manifest = json.loads((fx / "MANIFEST.json").read_text())
    manifest["spec_version"] = "0.0.1"
    (fx / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"spec version '0.0.1' but .* is '{SPEC_VERSION}'"):
        load_cases(fixtures_dir=fx)


def test_generator_reproduces_fixtures_byte_for_byte(tmp_path):
    generate.generate(tmp_path)
    assert generate.compare_dirs(tmp_path, FIXTURES_DIR) == []
    assert case_names(tmp_path) == case_names()


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------

def test_cli_reference_passes_everything(tmp_path):
    out = tmp_path / "results.json"
    r = cli("--backend", "reference", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    lines = r.stdout.strip().splitlines()
    n = len(case_names())
    assert lines[-1] == f"{n} passed, 0 failed, 0 skipped"
    assert lines[0].split() == ["backend", "case", "max_abs", "max_rel", "tolerance", "result"]
    table = rows(r.stdout)
    assert len(table) == n and all(v.startswith("PASS") for v in table.values())
    data = json.loads(out.read_text())
    assert data["summary"] == {"passed": n, "failed": 0, "skipped": 0}
    assert data["spec_version"] == SPEC_VERSION and len(data["results"]) == n


def test_cli_failing_adapter_in_worker(adapter_dir):
    r = cli("--backend", "perturbed", "--case", "dcmha,dcmha_bfloat16,mha",
            "--adapter", "perturbed=conformance_test_adapters:Perturbed", adapter_dir=adapter_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    table = rows(r.stdout)
    assert table["perturbed", "dcmha"].startswith("FAIL (output: ")
    assert table["perturbed", "mha"].startswith("FAIL")
    assert table["perturbed", "dcmha_bfloat16"].startswith("PASS")   # 1e-3 is bfloat16 noise
    assert SUMMARY.match(r.stdout.strip().splitlines()[-1]).groups() == ("1", "2", "0")


def test_cli_adapter_from_environment_and_skips(adapter_dir):
    env = {"DCMHA_CONFORMANCE_ADAPTERS": "forward-only=conformance_test_adapters:ForwardOnly"}
    r = cli("--backend", "forward-only,reference", "--case", "mha,grad_mha,decode_mha,mha_float16",
            adapter_dir=adapter_dir, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    table = rows(r.stdout)
    assert table["forward-only", "mha"].startswith("PASS")
    assert table["forward-only", "grad_mha"] == "SKIP (needs gradients; forward-only lacks it)"
    assert table["forward-only", "decode_mha"] == "SKIP (needs decode; forward-only lacks it)"
    assert table["forward-only", "mha_float16"] == "SKIP (needs float16; forward-only lacks it)"
    assert r.stdout.strip().splitlines()[-1] == "5 passed, 0 failed, 3 skipped"


@pytest.mark.parametrize("target,reason", [
    ("conformance_test_adapters:Crashes", "FAIL (worker exited with code 3 without results"),
    ("conformance_test_adapters:MissingOutput", "FAIL (missing output attention_scores)"),
    ("no_such_module_xyz:Adapter", "FAIL (adapter import failed: ModuleNotFoundError"),
])
def test_cli_broken_adapters_fail(adapter_dir, target, reason):
    r = cli("--backend", "broken", "--case", "mha", "--adapter", f"broken={target}",
            adapter_dir=adapter_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    assert rows(r.stdout)["broken", "mha"].startswith(reason)
    assert r.stdout.strip().splitlines()[-1] == "0 passed, 1 failed, 0 skipped"


def test_unimportable_adapter_is_skipped_under_all():
    cases = load_cases("mha")
    (res,) = import_failure("x", cases, "ModuleNotFoundError: no x", explicit=False)
    assert (res.status, res.reason) == ("SKIP", "adapter not importable: ModuleNotFoundError: no x")
    (res,) = import_failure("x", cases, "ModuleNotFoundError: no x", explicit=True)
    assert res.status == "FAIL"


def test_cli_usage_errors():
    r = cli("--backend", "no-such-backend")
    assert r.returncode == 2
    assert "unknown backend 'no-such-backend'; known backends: reference" in r.stderr
    r = cli("--case", "no_such_case*")
    assert r.returncode == 2 and "no case matches --case 'no_such_case*'" in r.stderr
    r = cli("--adapter", "nonsense")
    assert r.returncode == 2 and "NAME=MODULE:CLASS. Received: 'nonsense'" in r.stderr
    with pytest.raises(ValueError, match="Received: 'a=b'"):
        parse_adapter_specs(["a=b"])


def test_cli_list():
    r = cli("--list", "--case", "decode_*")
    assert r.returncode == 0
    lines = r.stdout.strip().splitlines()
    names = [n for n in case_names() if n.startswith("decode_")]
    assert [l.split()[0] for l in lines[:-1]] == names
    assert lines[-1].startswith(f"{len(names)} cases; backends: reference")
