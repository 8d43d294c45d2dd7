"""Telling a checkpoint directory in the release layout from a keras-hub preset, and
reading its tokenizer.json as untrusted input."""

import os

TOKENIZER_FILE = "tokenizer.json"


def read_tokenizer_json(path):
    """A tokenizer.json as a `tokenizers.Tokenizer`, checked: size, JSON nesting and the
    `tokenizers` library's own parse; a ValueError naming the file otherwise."""
    from tokenizers import Tokenizer

    from dcmha.checkpoints.files import label, read_json_object

    read_json_object(path, "tokenizer")          # size, UTF-8, nesting, an object
    with open(path, encoding="utf-8") as f:
        return check_tokenizer_text(f.read(), label(path), Tokenizer)


def check_tokenizer_text(text, name, tokenizer_cls):
    """tokenizer_cls.from_str(text), its failure as a ValueError naming `name`."""
    try:
        return tokenizer_cls.from_str(text)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ValueError(f"{name}: not a tokenizer the `tokenizers` library reads "
                         f"({reason}).") from None


def release_dir(preset):
    """The local directory when `preset` is in the authors' release layout (its
    config.json is an official config, not a Keras-serialised one); None when
    it is for keras-hub's own preset loader. ``hf://`` handles are downloaded
    first (an OSError with one line when that fails). A release directory's
    config.json and tokenizer.json (when there is one) are checked here, before any
    weight is read: a ValueError naming the file when either is malformed."""
    from dcmha.checkpoints import read_official_config, resolve_checkpoint_dir
    from dcmha.checkpoints.files import read_json_object

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
    if not os.path.isfile(config) or "registered_name" in read_json_object(config, "config"):
        return None
    read_official_config(directory)
    if os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
        read_tokenizer_json(os.path.join(directory, TOKENIZER_FILE))
    return directory
