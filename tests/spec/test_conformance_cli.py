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
    long = sum(p.stat().st_size for p in FIXTURES_DIR.glob("*long_*")
               if not p.name.startswith("decode_"))
    assert total < 3_300_000 and long < 500_000, (total, long)
    c = next(c for c in cases if c.name == "cross_attention")
    assert set(c.inputs) == {"query", "key", "value"}
    assert c.expected["output"].shape == (2, 6, 12) and c.cfg.cross_attention
    assert set(c.tolerance) == set(c.outputs) == {"output", "attention_scores"}
    assert [x.name for x in load_cases("grad_d*,mha")] == sorted(
        n for n in names if n.startswith("grad_d") or n == "mha")


def test_long_cases_cross_the_cpu_paths_thresholds():
    """Cases past T * S = 8192 (where "auto" takes torch / jax_cpu / tf_cpu on a CPU): forward
    and gradients, causal, windowed and masked, every switch, float32; they compare the output
    (and gradients) only, so "auto" is free to take those paths, which return no scores."""
    from dcmha.conformance.adapters.base import LONG_LENGTH_PRODUCT

    cases = [c for c in load_cases() if "long_sequences" in c.requires]
    assert LONG_LENGTH_PRODUCT == 8192
    for c in cases:
        T, S = c.dims["query_length"], c.dims["key_length"]
        assert T * S >= LONG_LENGTH_PRODUCT and c.dtype == "float32", c.name
        assert c.outputs[0] == "output" and "attention_scores" not in c.outputs, c.name
        assert set(c.expected) == set(c.outputs), c.name        # only what is compared is stored
    assert {c.kind for c in cases} == {"forward", "gradients"}

    def every_switch(c):
        g = c.cfg
        return bool(g.static_compose and g.qk_norm and g.rope_max_wavelength and g.use_bias
                    and g.N_kv < g.N and g.G > 1 and g.query_chunk_size and g.sliding_window
                    and c.call["use_causal_mask"])

    for kind in ("forward", "gradients"):
        of_kind = [c for c in cases if c.kind == kind]
        assert any(every_switch(c) for c in of_kind), kind
        assert any(c.call["use_causal_mask"] and not c.cfg.sliding_window for c in of_kind)
    assert any(not c.call["use_causal_mask"] and c.cfg.sliding_window for c in cases)
    assert any(c.call["has_attention_mask"] and not c.call["self_attention"] for c in cases)
    short = [c for c in load_cases() if "long_sequences" not in c.requires]
    assert all(c.dims["query_length"] * c.dims["key_length"] < LONG_LENGTH_PRODUCT for c in short)


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
    assert data["summary"] == {"passed": n, "failed": 0, "skipped": 0,
                               "passed_with_outputs_not_covered": 0}
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
    # it lacks the capability "attention_scores": compared on the output only, and says so
    assert table["forward-only", "mha"] == "PASS (output; not covered: attention_scores)"
    assert table["reference", "mha"] == "PASS (attention_scores)"
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
    assert [l.split()[0] for l in lines[:-2]] == names
    assert lines[-2].startswith(f"{len(names)} cases; backends: reference")
    assert lines[-1] == ("former names: triton-interpret = impl-triton, pallas-interpret = "
                         "impl-pallas, tf-xla = impl-xla")


# ---------------------------------------------------------------------------
# Outputs an adapter lacks the capability of
# ---------------------------------------------------------------------------

def test_case_with_no_covered_output_is_skipped_not_passed():
    import dataclasses

    from dcmha.conformance.adapters.reference import ReferenceAdapter
    from dcmha.conformance.runner import run_case

    class NoScores(ReferenceAdapter):
        capabilities = ReferenceAdapter.capabilities - {"attention_scores"}

    (case,) = load_cases("mha")
    res = run_case("no-scores", NoScores(), case)
    assert (res.status, res.not_covered, [o["name"] for o in res.outputs]) == (
        "PASS", ["attention_scores"], ["output"])
    scores_only = dataclasses.replace(case, outputs=("attention_scores",))
    res = run_case("no-scores", NoScores(), scores_only)
    assert (res.status, res.reason) == ("SKIP", "needs attention_scores; no-scores lacks it")


def test_an_adapter_may_skip_a_case_it_has_the_capabilities_for():
    from dcmha.conformance.adapters.reference import ReferenceAdapter
    from dcmha.conformance.runner import run_case

    class Picky(ReferenceAdapter):
        def skip_reason(self, case):
            return None if case.name == "mha" else f"not {case.name}"

    cases = {c.name: c for c in load_cases("mha,dcmha")}
    assert run_case("picky", Picky(), cases["mha"]).status == "PASS"
    res = run_case("picky", Picky(), cases["dcmha"])
    assert (res.status, res.reason) == ("SKIP", "not dcmha")


def test_one_query_calls_of_the_cases():
    from dcmha.conformance.adapters.base import decode_segments, has_one_query_call

    cases = {c.name: c for c in load_cases()}
    got = {n for n, c in cases.items() if has_one_query_call(c)}
    expected = {n for n, c in cases.items()
                if (c.dims["query_length"] == 1 if c.kind != "decode"
                    else 1 in [b - a for a, b in decode_segments(c)])}
    assert got == expected
    # Both kinds occur, and some decode case has only longer steps.
    assert "query_length_1" in got and "decode_single_tokens" in got
    assert "decode_multi_token_steps" not in got and "dcmha" not in got


def test_a_one_query_implementation_runs_only_cases_with_a_one_query_call():
    """impl-jax_decode computes one-query calls itself and runs the others through the plain
    core: it skips the cases without one (keras-jax covers them), and runs the others."""
    pytest.importorskip("jax")
    r = cli("--backend", "impl-jax_decode", "--case", "dcmha,query_length_1")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {case: result for (_, case), result in rows(r.stdout).items()}
    assert got["dcmha"] == ("SKIP (no one-query call: 'jax_decode' computes only those itself "
                            "and runs the others through the plain core)")
    assert got["query_length_1"].startswith("PASS") and "via jax_decode" in got["query_length_1"]


# ---------------------------------------------------------------------------
# Every registered implementation is an adapter
# ---------------------------------------------------------------------------

LIST_IMPLEMENTATIONS = ("import json; from dcmha import registry; print(json.dumps("
                        "{n: [i.backend, dict(i.cpu_env)] for n, i in "
                        "registry.implementations().items()}))")


@pytest.fixture(scope="module")
def implementations():
    r = subprocess.run([sys.executable, "-c", LIST_IMPLEMENTATIONS], capture_output=True,
                       text=True, env=dict(os.environ, KERAS_BACKEND="numpy"), timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_registered_implementation_is_an_adapter(implementations):
    from dcmha.conformance.runner import ALIASES, CPU_ONLY_ENV, discover_adapters, resolve_alias

    adapters = discover_adapters()
    impl = {n[len("impl-"):]: e for n, e in adapters.items() if n.startswith("impl-")}
    assert set(impl) == set(implementations) - {"ops"}
    assert {"torch", "jax_cpu", "tf_cpu", "xla", "triton", "pallas"} <= set(impl)
    for name, entry in impl.items():
        backend, cpu_env = implementations[name]
        assert entry.args == (name, backend)
        # the runner, not an import, sets the environment a path needs on a CPU
        assert entry.env == {**CPU_ONLY_ENV, "KERAS_BACKEND": backend, **cpu_env}
    assert impl["triton"].env["TRITON_INTERPRET"] == "1"
    for old, new in ALIASES.items():
        assert old not in adapters and resolve_alias(old, adapters) is adapters[new]
    r = cli("--list", "--case", "mha")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-2] == f"1 cases; backends: {', '.join(adapters)}"


def test_importing_the_suite_leaves_the_environment_alone():
    code = ("import os; before = dict(os.environ); import dcmha.conformance.__main__, "
            "dcmha.conformance.runner, dcmha.conformance.adapters.keras_adapter, "
            "dcmha.conformance.adapters.onnxruntime_adapter; print(dict(os.environ) == before)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "True"), r.stderr


def test_adapter_that_cannot_run_here_fails_when_named_and_skips_under_all():
    from dcmha.conformance.runner import AdapterEntry, run_backend

    entry = AdapterEntry("x:y", unavailable="its Keras backend 'jax' is not installed")
    cases = load_cases("mha")
    (named,) = run_backend("impl-x", entry, cases, explicit=True)
    (under_all,) = run_backend("impl-x", entry, cases, explicit=False)
    reason = "cannot run here: its Keras backend 'jax' is not installed"
    assert (named.status, named.reason) == ("FAIL", reason)
    assert (under_all.status, under_all.reason) == ("SKIP", reason)


# ---------------------------------------------------------------------------
# Hard edges of the command line and the loader (issue 14)
# ---------------------------------------------------------------------------

def test_json_report_in_a_missing_directory_is_refused_before_the_run(tmp_path):
    r = cli("--json", "missing_dir/report.json", env={"PWD": str(tmp_path)})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("error: `--json` must be in an existing directory; 'missing_dir' does "
                        "not exist. Received: --json missing_dir/report.json\n")
    r = cli("--json", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"error: `--json` must name a file, not a directory. Received: --json "
                        f"{tmp_path}\n")


@pytest.mark.parametrize("entry", ["../x.json", "/etc/x.json", "sub/x.json"])
def test_manifest_entries_cannot_leave_the_fixtures_directory(tmp_path, entry):
    fx = tmp_path / "fixtures"
    shutil.copytree(FIXTURES_DIR, fx)
    (tmp_path / "x.json").write_text("{}")
    manifest = json.loads((fx / "MANIFEST.json").read_text())
    manifest["files"][entry] = sha256_file(tmp_path / "x.json")
    (fx / "MANIFEST.json").write_text(json.dumps(manifest))
    message = (f"{fx / 'MANIFEST.json'} is not a valid manifest: the entry {entry!r} is not a "
               "file name inside the fixtures directory (entries are plain names such as "
               "'mha.json', each mapped to a sha256 string).")
    with pytest.raises(ValueError) as err:
        load_cases(fixtures_dir=fx)
    assert str(err.value) == message
    r = cli("--fixtures", str(fx))
    assert (r.returncode, r.stderr) == (1, f"error: {message}\n")


def test_a_case_name_cannot_leave_the_fixtures_directory():
    from dcmha.conformance import load_case

    with pytest.raises(ValueError) as err:
        load_case("../fixtures/mha")
    assert str(err.value) == ("A case name must name a file inside the fixtures directory. "
                              "Received: name='../fixtures/mha'")


@pytest.mark.parametrize("field,value,message", [
    ("outputs", 5, "`outputs` must be a non-empty list of distinct output names. "
                   "Received: outputs=5"),
    ("kind", "backward", "`kind` must be one of ['forward', 'gradients', 'decode']. "
                         "Received: kind='backward'"),
    ("requires", "forward", "`requires` must be a list of capability names. "
                            "Received: requires='forward'"),
    ("tolerance", {"output": {"atol": "1e-5"}},
     "`tolerance['output']` must be an object with non-negative numbers 'atol' and 'rtol'. "
     "Received: tolerance['output']={'atol': '1e-5'}"),
    ("call", {"use_causal_mask": 1}, "`call` must be an object with booleans "
                                     "'use_causal_mask' and 'self_attention'. "
                                     "Received: call={'use_causal_mask': 1}"),
])
def test_malformed_case_field_is_a_clear_error(tmp_path, field, value, message):
    fx = tmp_path / "fixtures"
    shutil.copytree(FIXTURES_DIR, fx)
    meta = json.loads((fx / "mha.json").read_text())
    meta[field] = value
    (fx / "mha.json").write_text(json.dumps(meta))
    manifest = json.loads((fx / "MANIFEST.json").read_text())
    manifest["files"]["mha.json"] = sha256_file(fx / "mha.json")
    (fx / "MANIFEST.json").write_text(json.dumps(manifest))
    full = f"Fixture file {fx / 'mha.json'} is not a valid case: {message}"
    with pytest.raises(ValueError) as err:
        load_cases("mha", fixtures_dir=fx)
    assert str(err.value) == full
    r = cli("--fixtures", str(fx), "--case", "mha")
    assert (r.returncode, r.stderr) == (1, f"error: {full}\n")


def test_cli_needs_no_configured_keras_backend(tmp_path):
    """No KERAS_BACKEND and a keras.json naming a backend that does not exist: the command line
    still lists and runs (it never imports Keras; workers get their backend from the runner)."""
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "no_such_backend"}))
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    code = ("import sys; from dcmha.conformance.__main__ import main; "
            "rc = main(sys.argv[1:]); print('keras' in sys.modules, rc)")
    for args in (["--list", "--case", "mha"], ["--backend", "reference", "--case", "mha"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[-1] == "False 0", r.stdout


def test_implementation_on_any_backend_is_checked_on_each(monkeypatch):
    from dcmha.conformance import runner

    rows = [dict(name="ops", backend="any", devices=["cpu", "gpu"], cpu_env={}),
            dict(name="anywhere", backend="any", devices=["cpu"], cpu_env={}),
            dict(name="gpu_only", backend="numpy", devices=["gpu"], cpu_env={})]
    monkeypatch.setattr(runner, "_registered_implementations",
                        lambda: (rows, {"broken": "ImportError: no module x"}))
    entries = runner.implementation_entries()
    assert sorted(entries) == ["impl-anywhere-jax", "impl-anywhere-numpy",
                               "impl-anywhere-tensorflow", "impl-anywhere-torch",
                               "impl-broken", "impl-gpu_only"]
    assert entries["impl-anywhere-torch"].args == ("anywhere", "torch")
    assert entries["impl-anywhere-torch"].env["KERAS_BACKEND"] == "torch"
    assert entries["impl-gpu_only"].unavailable == (
        "it runs on gpu only and declares no cpu_env to run on a CPU")
    assert entries["impl-broken"].unavailable == (
        "its entry point failed to load: ImportError: no module x")
