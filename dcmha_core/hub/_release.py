"""Telling a checkpoint directory in the release layout from a keras-hub preset."""

import json
import os


def release_dir(preset):
    """The local directory when `preset` is in the authors' release layout (its
    config.json is an official config, not a Keras-serialised one); None when
    it is for keras-hub's own preset loader. ``hf://`` handles are downloaded
    first (an OSError with one line when that fails)."""
    from dcmha.checkpoints import resolve_checkpoint_dir

    if isinstance(preset, os.PathLike):
        preset = os.fspath(preset)
    if not isinstance(preset, str):
        return None
    if preset.startswith("hf://"):
        directory = resolve_checkpoint_dir(preset)
    elif os.path.isdir(preset):
        directory = preset
    else:
        return None
    config = os.path.join(directory, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        return None if "registered_name" in json.load(f) else directory
