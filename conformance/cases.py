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
import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from dcmha.spec import reference

#: The fixtures shipped with the package.
FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
MANIFEST_NAME = "MANIFEST.json"

PathLike = Union[str, Path]


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


def sha256_file(path: PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_manifest(fixtures_dir: Optional[PathLike] = None) -> dict:
    """The manifest of ``fixtures_dir`` (default: the packaged fixtures), spec version checked."""
    root = Path(fixtures_dir) if fixtures_dir is not None else FIXTURES_DIR
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"No {MANIFEST_NAME} in the fixtures directory {root}. "
                         "Generate the fixtures with `python -m dcmha.conformance.generate`.")
    manifest = json.loads(path.read_text())
    if manifest.get("spec_version") != reference.SPEC_VERSION:
        raise ValueError(
            f"The fixtures in {root} were generated for spec version "
            f"{manifest.get('spec_version')!r} but dcmha.spec.reference is "
            f"{reference.SPEC_VERSION!r}; regenerate them with `python -m dcmha.conformance.generate`.")
    return manifest


def verify_file(path: Path, manifest: Mapping) -> bytes:
    """The bytes of ``path`` after checking its sha256 against the manifest (ValueError if not)."""
    files = manifest["files"]
    if path.name not in files:
        raise ValueError(f"Fixture file {path} is not listed in {MANIFEST_NAME}.")
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


def load_case(name: str, fixtures_dir: Optional[PathLike] = None,
              manifest: Optional[Mapping] = None) -> Case:
    """Load and verify one case by name."""
    import io

    root = Path(fixtures_dir) if fixtures_dir is not None else FIXTURES_DIR
    manifest = manifest if manifest is not None else read_manifest(root)
    meta = json.loads(verify_file(root / f"{name}.json", manifest))
    arrays = {}
    with np.load(io.BytesIO(verify_file(root / f"{name}.npz", manifest)),
                 allow_pickle=False) as npz:
        for key in npz.files:
            arrays[key] = npz[key]

    def section(prefix: str) -> Dict[str, np.ndarray]:
        return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}

    return Case(
        name=meta["name"], description=meta["description"], kind=meta["kind"],
        config=dict(meta["config"]), cfg=reference.Config.from_dict(meta["config"]),
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
