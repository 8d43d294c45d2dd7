"""DCFormerCausalLMPreprocessor: strings -> token ids, padding mask and next-token labels."""

import keras
from keras_hub.src.models.causal_lm_preprocessor import CausalLMPreprocessor

from dcmha.hub._release import release_dir
from dcmha.hub.backbone import DCFormerBackbone
from dcmha.hub.tokenizer import DCFormerTokenizer


@keras.saving.register_keras_serializable(package="dcmha")
class DCFormerCausalLMPreprocessor(CausalLMPreprocessor):
    """keras-hub's `CausalLMPreprocessor` with a `DCFormerTokenizer`.

    Calling it on strings gives ``({"token_ids", "padding_mask"}, labels,
    sample_weight)``, each (B, sequence_length), padded on the right; the
    start token is prepended and the end token appended when the tokenizer has
    them. `generate_preprocess` / `generate_postprocess` serve
    `DCFormerCausalLM.generate`.

    Args:
        tokenizer: a `DCFormerTokenizer`.
        sequence_length: packed length.
        add_start_token, add_end_token: as keras-hub's.

    `from_preset` also takes a release-layout directory or ``hf://`` handle.
    """

    backbone_cls = DCFormerBackbone
    tokenizer_cls = DCFormerTokenizer

    def __init__(self, tokenizer, sequence_length=1024, add_start_token=True,
                 add_end_token=True, **kwargs):
        super().__init__(tokenizer=tokenizer, sequence_length=sequence_length,
                         add_start_token=add_start_token and tokenizer.start_token_id is not None,
                         add_end_token=add_end_token and tokenizer.end_token_id is not None,
                         **kwargs)

    @classmethod
    def from_preset(cls, preset, config_file="preprocessor.json", **kwargs):
        directory = release_dir(preset)
        if directory is None:
            return super().from_preset(preset, config_file=config_file, **kwargs)
        return cls(tokenizer=cls.tokenizer_cls.from_preset(directory), **kwargs)
