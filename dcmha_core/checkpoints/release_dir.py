"""Checkpoint directories in the authors' release layout, local or ``hf://owner/name``:

    config.json                                  the official config (a Hugging Face config)
    pytorch_model.bin                            one torch.save'd state dict, or shards:
    pytorch_model-00001-of-0000N.bin + pytorch_model.bin.index.json
    model.safetensors                            or shards:
    model-00001-of-0000N.safetensors + model.safetensors.index.json
    tokenizer.json                               (read by dcmha.hub.DCFormerTokenizer)

An index file is JSON {"metadata": {...}, "weight_map": {name: shard file name}}. Every
file is read as untrusted input (see `dcmha.checkpoints.files`): a bad one raises a
ValueError naming it.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np

from dcmha.checkpoints.files import (float32_to_bfloat16, is_int, label, read_json_object,
                                      short)
from dcmha.checkpoints.convert import (_to_numpy, from_official_state_dict,
                                       official_config_to_kwargs)
from dcmha.checkpoints.safetensors import read_safetensors, write_safetensors
from dcmha.checkpoints.torch_bin import read_torch_bin, write_torch_bin

_WEIGHT_FORMATS = (  # (index file, single file, reader), safetensors first
    ("model.safetensors.index.json", "model.safetensors", read_safetensors),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", read_torch_bin),
)


def _weight_map(path) -> dict:
    """An index file's weight_map {tensor name: shard file name}, checked."""
    index = label(path)
    weight_map = read_json_object(path, "checkpoint index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no 'weight_map' {{name: file}} in the index file.")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ValueError(f"{index}: weight_map[{short(name)}] is a "
                             f"{type(shard).__name__}, not a shard file name.")
    return weight_map


def _read_sharded(directory, index, reader) -> dict:
    weight_map = _weight_map(os.path.join(directory, index))
    sd = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(directory, shard)
        if os.path.basename(shard) != shard or not os.path.isfile(shard_path):
            raise ValueError(f"{index} names the shard {short(shard)}, which is not a file "
                             f"in {directory}.")
        part = reader(shard_path)
        twice = next((k for k in part if k in sd), None)
        if twice is not None:
            raise ValueError(f"{shard}: the tensor {short(twice)} is also in another shard.")
        sd.update(part)
    missing = sorted(set(weight_map) - set(sd))
    if missing:
        raise ValueError(f"{index} maps {short(missing[:5])} to shards that do not hold them.")
    return sd


def load_official_state_dict(directory) -> dict:
    """The state dict of a checkpoint directory in the release layout (NumPy arrays).

    Reads ``model.safetensors`` (or its shards with ``model.safetensors.index.json``)
    when present, else ``pytorch_model.bin`` (or its shards with
    ``pytorch_model.bin.index.json``); see `read_torch_bin` / `read_safetensors`.
    """
    directory = os.fspath(directory)
    for index, single, reader in _WEIGHT_FORMATS:
        if os.path.isfile(os.path.join(directory, index)):
            return _read_sharded(directory, index, reader)
        if os.path.isfile(os.path.join(directory, single)):
            return reader(os.path.join(directory, single))
    raise ValueError(f"{directory} holds no weights: expected model.safetensors, "
                     "pytorch_model.bin, or one of their .index.json files with shards. "
                     f"Found: {sorted(os.listdir(directory))[:10]}")


def resolve_checkpoint_dir(path_or_handle) -> str:
    """A local directory for a directory path or an ``hf://owner/name`` handle
    (downloaded with huggingface_hub, or taken from its cache)."""
    handle = os.fspath(path_or_handle)
    if handle.startswith("hf://"):
        repo = handle[len("hf://"):].strip("/")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise ValueError("A Hugging Face handle is 'hf://owner/name'. Received: "
                             f"{handle!r}")
        try:
            import huggingface_hub
        except ImportError:
            raise ImportError(f"Loading {handle} needs huggingface_hub: "
                              "pip install 'dcmha[hub]'.") from None
        try:
            return huggingface_hub.snapshot_download(
                repo, allow_patterns=["*.json", "*.bin", "*.safetensors", "*.model"])
        except Exception as err:  # noqa: BLE001 - one clear line instead of a network trace
            reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise OSError(f"Could not download {handle} from the Hugging Face Hub "
                          f"({type(err).__name__}: {reason}). Check the network and the "
                          "repository name, or pass a local directory.") from None
    if not os.path.isdir(handle):
        raise ValueError("`path_or_handle` must be a checkpoint directory (config.json plus "
                         "weights) or 'hf://owner/name'. Received: "
                         f"path_or_handle={handle!r}")
    return handle


def read_official_config(directory) -> dict:
    """config.json of a checkpoint directory, checked: a JSON object whose keys that
    `official_config_to_kwargs` reads hold supported values (a ValueError naming the file
    otherwise)."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory} has no config.json (the official DCFormer config).")
    config = read_json_object(path, "config")
    try:
        official_config_to_kwargs(config)
    except ValueError as err:
        raise ValueError(f"config.json: {err}") from None
    return config


def from_official_directory(path_or_handle, *, dtype=None, **overrides):
    """`from_official_state_dict` on a checkpoint directory (or ``hf://owner/name``):
    config.json plus the weights read by `load_official_state_dict`."""
    directory = resolve_checkpoint_dir(path_or_handle)
    config = read_official_config(directory)
    return from_official_state_dict(load_official_state_dict(directory), config, dtype=dtype,
                                    **overrides)


def write_official_directory(directory, state_dict: Mapping, config: Mapping, *,
                             format: str = "safetensors", dtype: str = "float32",
                             num_shards: int = 1, views: Mapping | None = None,
                             tokenizer_json=None) -> str:
    """Write a checkpoint directory in the release layout (the inverse of
    `from_official_directory`), with NumPy only.

    Args:
        directory: created if needed.
        state_dict: {name: array}, e.g. from `to_official_state_dict`.
        config: the official config dict, written as config.json.
        format: "safetensors" (model*.safetensors) or "bin" (pytorch_model*.bin,
            a torch.save-compatible zip archive, written without torch).
        dtype: "float32", "float16" or "bfloat16" for the floating-point entries.
        num_shards: > 1 splits the entries over that many files plus an index json.
        views: "bin" only: {name: (base name, offset, shape, stride)} entries
            stored as views of another entry's storage (as the official qkw_m).
        tokenizer_json: a `tokenizers.Tokenizer` (or the JSON text of one), written
            as tokenizer.json.

    Returns:
        The directory.
    """
    if format not in ("safetensors", "bin"):
        raise ValueError(f"`format` must be 'safetensors' or 'bin'. Received: format={format!r}")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError("`dtype` must be 'float32', 'float16' or 'bfloat16'. Received: "
                         f"dtype={dtype!r}")
    if not is_int(num_shards) or num_shards < 1:
        raise ValueError(f"`num_shards` must be a positive integer. Received: "
                         f"num_shards={num_shards!r}")
    views = dict(views or {})
    if views and format != "bin":
        raise ValueError("`views` are only stored by format='bin'.")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for name, value in state_dict.items():
        a = _to_numpy(name, value)
        if np.issubdtype(a.dtype, np.floating):
            a = float32_to_bfloat16(a) if dtype == "bfloat16" else a.astype(dtype)
            tensors[str(name)] = (a, dtype)
        else:
            tensors[str(name)] = (a, a.dtype.name)
    for name, (base, *_rest) in views.items():
        if base not in tensors:
            raise ValueError(f"`views[{name!r}]` refers to {base!r}, which is not in state_dict.")
    names = list(tensors)
    num_shards = min(int(num_shards), len(names)) or 1
    ext = "safetensors" if format == "safetensors" else "bin"
    stem = "model" if format == "safetensors" else "pytorch_model"
    weight_map = {}
    for s in range(num_shards):
        part = {n: tensors[n] for n in names[s::num_shards]}
        part_views = {n: v for n, v in views.items() if v[0] in part}
        fname = (f"{stem}.{ext}" if num_shards == 1
                 else f"{stem}-{s + 1:05d}-of-{num_shards:05d}.{ext}")
        path = os.path.join(directory, fname)
        if format == "bin":
            write_torch_bin(path, part, part_views)
        else:
            write_safetensors(path, part)
        weight_map.update({n: fname for n in [*part, *part_views]})
    if num_shards > 1:
        with open(os.path.join(directory, f"{stem}.{ext}.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(config), f, indent=1)
    if tokenizer_json is not None:
        text = tokenizer_json if isinstance(tokenizer_json, str) else tokenizer_json.to_str()
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            f.write(text)
    return directory
