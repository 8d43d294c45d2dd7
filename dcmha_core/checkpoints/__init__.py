"""Load official DCFormer PyTorch checkpoints into `dcmha.models.DCFormerLM`, and write them.

    convert       the official state dict layout and config <-> DCFormerLM's weights and
                  arguments (`from_official_state_dict`, `to_official_state_dict`, ...)
    torch_bin     torch.save zip archives (pytorch_model*.bin), read and written without
                  torch; the pickle is read by a restricted machine that runs no code
    safetensors   .safetensors files, read and written with NumPy alone
    release_dir   checkpoint directories in the release layout, local or ``hf://owner/name``
    files         what the readers share: limits, bounded JSON reading, file labels for
                  messages, the bfloat16 / float8 conversions

Every file is read as untrusted input: a malformed one raises a ValueError (an OSError
when it cannot be read) naming the file and what is wrong in it, after bounded work.
"""

from dcmha.checkpoints.convert import (OFFICIAL_DEFAULTS, assign_official_state_dict,
                                       from_official_state_dict, official_config_to_kwargs,
                                       official_intermediate_size, official_model_arguments,
                                       to_official_state_dict)
from dcmha.checkpoints.release_dir import (from_official_directory, load_official_state_dict,
                                           read_official_config, resolve_checkpoint_dir,
                                           write_official_directory)
from dcmha.checkpoints.safetensors import read_safetensors
from dcmha.checkpoints.torch_bin import read_torch_bin

__all__ = ["from_official_state_dict", "official_config_to_kwargs", "to_official_state_dict",
           "official_model_arguments", "read_torch_bin", "read_safetensors",
           "load_official_state_dict", "read_official_config", "from_official_directory",
           "resolve_checkpoint_dir", "write_official_directory", "official_intermediate_size",
           "OFFICIAL_DEFAULTS", "assign_official_state_dict"]
