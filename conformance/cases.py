"""Conformance cases: the framework-free fixture files and their loader.

Each case is ``<name>.json`` (what to run and how close to be) plus ``<name>.npz`` (inputs,
canonical parameters, expected arrays); ``MANIFEST.json`` records the spec version and the
sha256 of every file. The loader refuses any file whose checksum differs from the manifest.
The file format is described in ``conformance/README.md``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from dcmha.checkpoints.files import MAX_JSON_BYTES, parse_json, short
from dcmha.spec import reference

#: The fixtures shipped with the package.
FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
MANIFEST_NAME = "MANIFEST.json"

PathLike = Union[str, Path]

#: A case's .npz may inflate to at most this many times its size, plus NPZ_SLACK bytes
#: (the fixtures are stored uncompressed: about 1x).
NPZ_RATIO, NPZ_SLACK = 16, 1 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One conformance case, loaded and checksum-verified.

    ``inputs`` keys drop the "input/" prefix ("query", "key", "value", "attention_mask",
    "d_output"); ``params`` are the canonical parameters; ``expected`` keys drop "expected/"
    ("output", "attention_scores", "grad/query", "dynamic/pre_query/w1", ...). Float arrays are
    float32 (float16/bfloat16 cases hold values exactly representable in that dtype); masks bool.
    """

    name: str
    description: str
    kind: str
    config: dict
    cfg: reference.Config
    dims: dict
    dtype: str
    call: dict
    requires: Tuple[str, ...]
    outputs: Tuple[str, ...]
    tolerance: Dict[str, Dict[str, float]]
    inputs: Dict[str, np.ndarray]
    params: Dict[str, np.ndarray]
    expected: Dict[str, np.ndarray]
    meta: dict = dataclasses.field(repr=False)
    path: Optional[Path] = dataclasses.field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"Case({self.name!r}, kind={self.kind!r}, dtype={self.dtype!r})"


def _is_plain_name(name) -> bool:
    """Whether ``name`` names a file directly inside a directory (no separator, no "..")."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and Path(name).name == name
            and not Path(name).is_absolute())


def sha256_file(path: PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_manifest(fixtures_dir: Optional[PathLike] = None) -> dict:
    """The manifest of ``fixtures_dir`` (default: the packaged fixtures), spec version checked."""
    root = Path(fixtures_dir) if fixtures_dir is not None else FIXTURES_DIR
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"No {MANIFEST_NAME} in the fixtures directory {root}. "
                         "Generate the fixtures with `python -m dcmha.conformance.generate`.")
    try:
        with open(path, "rb") as f:
            manifest = parse_json(f.read(MAX_JSON_BYTES + 1), str(path), "manifest")
    except ValueError:
        manifest = None
    if (not isinstance(manifest, dict) or "spec_version" not in manifest
            or not isinstance(manifest.get("files"), dict)):
        raise ValueError(f"{path} is not a valid manifest (a JSON object with 'spec_version' "
                         "and 'files'). Regenerate the fixtures with "
                         "`python -m dcmha.conformance.generate`.")
    for name, digest in manifest["files"].items():
        if not _is_plain_name(name) or not isinstance(digest, str):
            raise ValueError(
                f"{path} is not a valid manifest: the entry {short(name)} is not a file name "
                "inside "
                "the fixtures directory (entries are plain names such as 'mha.json', each "
                "mapped to a sha256 string).")
    if manifest.get("spec_version") != reference.SPEC_VERSION:
        raise ValueError(
            f"The fixtures in {root} were generated for spec version "
            f"{short(manifest.get('spec_version'))} but dcmha.spec.reference is "
            f"{reference.SPEC_VERSION!r}; regenerate them with `python -m dcmha.conformance.generate`.")
    return manifest


def verify_file(path: Path, manifest: Mapping) -> bytes:
    """The bytes of ``path`` after checking its sha256 against the manifest (ValueError if not)."""
    files = manifest["files"]
    if path.name not in files or not _is_plain_name(path.name):
        raise ValueError(f"Fixture file {path} is not listed in {MANIFEST_NAME}.")
    if not path.is_file():
        raise ValueError(f"Fixture file {path} is listed in {MANIFEST_NAME} but does not exist.")
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != files[path.name]:
        raise ValueError(
            f"Fixture file {path} does not match {MANIFEST_NAME}: expected sha256 "
            f"{files[path.name]}, received {got}. Restore it or regenerate the fixtures with "
            "`python -m dcmha.conformance.generate`.")
    return data


def case_names(fixtures_dir: Optional[PathLike] = None) -> List[str]:
    """Names of all cases listed in the manifest, sorted."""
    files = read_manifest(fixtures_dir)["files"]
    return sorted(f[:-5] for f in files if f.endswith(".json") and f != MANIFEST_NAME)


def _match(name: str, pattern: Optional[Union[str, Sequence[str]]]) -> bool:
    if pattern is None:
        return True
    pats = pattern.split(",") if isinstance(pattern, str) else list(pattern)
    return any(fnmatch.fnmatchcase(name, p.strip()) for p in pats if p.strip())


_CASE_KEYS = ("name", "description", "kind", "config", "dims", "dtype", "call", "requires",
              "outputs", "tolerance")
KINDS = ("forward", "gradients", "decode")
DTYPES = ("float32", "float16", "bfloat16")
_DIMS = ("batch", "query_length", "key_length", "query_input_dim", "key_input_dim")


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def _str_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def _field_problem(name: str, meta: Mapping) -> Optional[Tuple[str, str, object]]:
    """(field, what it must be, received value) of the first malformed field, or None."""
    call, dims, outputs = meta["call"], meta["dims"], meta["outputs"]
    checks = [
        ("name", f"the case's file name {name!r}", meta["name"], meta["name"] == name),
        ("description", "a string", meta["description"], isinstance(meta["description"], str)),
        ("kind", f"one of {list(KINDS)}", meta["kind"], meta["kind"] in KINDS),
        ("dtype", f"one of {list(DTYPES)}", meta["dtype"], meta["dtype"] in DTYPES),
        ("config", "an object of dcmha.spec.reference.Config arguments", meta["config"],
         isinstance(meta["config"], dict)),
        ("dims", f"an object with positive integers {list(_DIMS)} (and optional 'output_dim')",
         dims, isinstance(dims, dict) and all(_positive_int(dims.get(k)) for k in _DIMS)
         and _positive_int(dims.get("output_dim", 1))),
        ("call", "an object with booleans 'use_causal_mask' and 'self_attention'", call,
         isinstance(call, dict) and all(isinstance(call.get(k), bool)
                                        for k in ("use_causal_mask", "self_attention"))),
        ("requires", "a list of capability names", meta["requires"],
         _str_list(meta["requires"])),
        ("outputs", "a non-empty list of distinct output names", outputs,
         _str_list(outputs) and outputs and len(set(outputs)) == len(outputs)),
    ]
    for field, must, got, ok in checks:
        if not ok:
            return field, must, got
    if meta["kind"] == "decode":
        steps = call.get("decode_steps")
        if not (isinstance(steps, list) and steps and all(_positive_int(n) for n in steps)):
            return "call.decode_steps", "a non-empty list of positive integers", steps
        if "cache_length" in call and not _positive_int(call["cache_length"]):
            return "call.cache_length", "a positive integer", call["cache_length"]
    tolerance = meta["tolerance"]
    if not isinstance(tolerance, dict):
        return "tolerance", "an object {output: {'atol', 'rtol'}}", tolerance
    for out in outputs:
        t = tolerance.get(out)
        if not (isinstance(t, dict) and _number(t.get("atol")) and _number(t.get("rtol"))):
            return (f"tolerance[{out!r}]", "an object with non-negative numbers 'atol' and "
                    "'rtol'", t)
    return None


def _check_arrays(path: Path, cfg: reference.Config, meta: Mapping, arrays: Mapping) -> None:
    """The arrays a case needs are in its .npz, the parameters with the config's shapes."""
    dims = meta["dims"]
    try:
        shapes = reference.param_shapes(cfg, dims["query_input_dim"], dims["key_input_dim"],
                                        dims.get("output_dim"))
    except (KeyError, TypeError):
        raise ValueError(f"Fixture file {path.with_suffix('.json')} is not a valid case: "
                         "'dims' lacks query_input_dim / key_input_dim.") from None
    want = {"param/" + n: s for n, s in shapes.items()}
    want["input/query"] = None
    want.update({"expected/" + n: None for n in meta["outputs"]})
    missing = sorted(set(want) - set(arrays))
    if missing:
        raise ValueError(f"Fixture file {path} does not fit its case: missing arrays {missing}.")
    unexpected = sorted(n for n in arrays if n.startswith("param/") and n not in want)
    if unexpected:
        raise ValueError(f"Fixture file {path} does not fit its case: unexpected arrays "
                         f"{unexpected}.")
    for n, shape in want.items():
        if shape is not None and tuple(arrays[n].shape) != tuple(shape):
            raise ValueError(f"Fixture file {path} does not fit its case: {n!r} has shape "
                             f"{tuple(arrays[n].shape)}, expected {tuple(shape)}.")


def _read_npz(path: Path, data: bytes) -> Dict[str, np.ndarray]:
    """The arrays of a case's .npz (its bytes), every member a ``.npy`` file, the members'
    inflated size checked against the archive's before any is read."""
    import io
    import zipfile

    def refuse(why):
        raise ValueError(f"Fixture file {path} is not a readable .npz archive: {why}.")

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError):
        refuse("not a zip archive")
    names = [i.filename for i in infos]
    odd = [n for n in names if not n.endswith(".npy")]
    if odd or len(set(names)) != len(names):
        refuse(f"every member must be a distinct '.npy' file; received {short(odd or names)}")
    inflated = sum(i.file_size for i in infos)
    if inflated > NPZ_RATIO * len(data) + NPZ_SLACK:
        refuse(f"its members inflate to {inflated} bytes, more than {NPZ_RATIO} times its "
               f"{len(data)}")
    arrays = {}
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            for key in npz.files:
                arrays[key] = npz[key]
    except Exception as err:  # noqa: BLE001 - zipfile.BadZipFile, ValueError, OSError, EOFError...
        refuse(f"{type(err).__name__}: {str(err)[:120]}")
    return arrays


def load_case(name: str, fixtures_dir: Optional[PathLike] = None,
              manifest: Optional[Mapping] = None) -> Case:
    """Load and verify one case by name."""
    root = Path(fixtures_dir) if fixtures_dir is not None else FIXTURES_DIR
    if not _is_plain_name(f"{name}.json"):
        raise ValueError("A case name must name a file inside the fixtures directory. "
                         f"Received: name={name!r}")
    manifest = manifest if manifest is not None else read_manifest(root)
    json_path, npz_path = root / f"{name}.json", root / f"{name}.npz"
    raw = verify_file(json_path, manifest)
    try:
        meta = parse_json(raw, str(json_path), "case")
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise ValueError(f"Fixture file {json_path} is not a valid case: not a JSON object.")
    missing = sorted(set(_CASE_KEYS) - set(meta))
    if missing:
        raise ValueError(f"Fixture file {json_path} is not a valid case: missing keys {missing}.")
    problem = _field_problem(name, meta)
    if problem is not None:
        field, must, got = problem
        raise ValueError(f"Fixture file {json_path} is not a valid case: `{field}` must be "
                         f"{must}. Received: {field}={short(got)}")
    try:
        cfg = reference.Config.from_dict(meta["config"])
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"Fixture file {json_path} is not a valid case: `config` is not "
                         f"dcmha.spec.reference.Config's arguments ({str(err)[:200]}).") from None
    arrays = _read_npz(npz_path, verify_file(npz_path, manifest))
    _check_arrays(npz_path, cfg, meta, arrays)

    def section(prefix: str) -> Dict[str, np.ndarray]:
        return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}

    return Case(
        name=meta["name"], description=meta["description"], kind=meta["kind"],
        config=dict(meta["config"]), cfg=cfg,
        dims=dict(meta["dims"]), dtype=meta["dtype"], call=dict(meta["call"]),
        requires=tuple(meta["requires"]), outputs=tuple(meta["outputs"]),
        tolerance={k: dict(v) for k, v in meta["tolerance"].items()},
        inputs=section("input/"), params=section("param/"), expected=section("expected/"),
        meta=meta, path=root / f"{name}.json")


def load_cases(pattern: Optional[Union[str, Sequence[str]]] = None,
               fixtures_dir: Optional[PathLike] = None) -> List[Case]:
    """All cases whose name matches ``pattern`` (glob, or comma-separated globs), sorted by name.

    ``fixtures_dir`` defaults to the packaged fixtures. Raises ValueError naming the file when a
    file's sha256 differs from MANIFEST.json (or the file is not listed there).
    """
    manifest = read_manifest(fixtures_dir)
    return [load_case(n, fixtures_dir, manifest) for n in case_names(fixtures_dir)
            if _match(n, pattern)]


__all__ = ["Case", "FIXTURES_DIR", "MANIFEST_NAME", "case_names", "load_case", "load_cases",
           "read_manifest", "sha256_file", "verify_file"]
