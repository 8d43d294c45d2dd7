"""DCFormerTokenizer: a Hugging Face tokenizer.json as a keras-hub Tokenizer."""

import os

import keras
import numpy as np
from keras_hub.src.tokenizers.tokenizer import Tokenizer
from keras_hub.src.utils.tensor_utils import (canonicalize_python_string_inputs,
                                              canonicalize_python_token_inputs,
                                              preprocessing_function)

from dcmha.checkpoints import read_official_config
from dcmha.checkpoints.files import short
from dcmha.hub.backbone import DCFormerBackbone
from dcmha.hub._release import (TOKENIZER_FILE, check_tokenizer_text, read_tokenizer_json,
                                release_dir)

try:
    import tensorflow as tf
except ImportError:  # the python path needs no TensorFlow
    tf = None

def _check_id(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                              or value < 0):
        raise ValueError(f"`{name}` must be None or a non-negative integer. Received: "
                         f"{name}={value!r}")


@keras.saving.register_keras_serializable(package="dcmha")
class DCFormerTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (tokenizer.json) behind keras-hub's Tokenizer contract.

    Strings -> token ids with `tokenize` (a 1-D int32 array for one string, a
    list of lists for a batch; a `tf.RaggedTensor` inside `tf.data`), ids ->
    strings with `detokenize`. Special tokens are not added here: the
    preprocessor's packer adds `start_token_id` / `end_token_id`.

    Args:
        vocabulary: the tokenizer.json text, a path to it, or None (set later by
            `load_assets`, as keras-hub presets do).
        start_token_id: id of the start (bos) token, or None.
        end_token_id: id of the end (eos) token, or None.
        pad_token_id: id written at padded positions (masked out, so any id
            but the end token's); None -> 0 (1 when the end token is 0).
    """

    backbone_cls = DCFormerBackbone

    def __init__(self, vocabulary=None, start_token_id=None, end_token_id=None,
                 pad_token_id=None, **kwargs):
        kwargs.setdefault("dtype", "int32")
        super().__init__(**kwargs)
        for name, value in (("start_token_id", start_token_id), ("end_token_id", end_token_id),
                            ("pad_token_id", pad_token_id)):
            _check_id(name, value)
        self.start_token_id = None if start_token_id is None else int(start_token_id)
        self.end_token_id = None if end_token_id is None else int(end_token_id)
        if pad_token_id is None:
            pad_token_id = 1 if self.end_token_id == 0 else 0
        if pad_token_id == self.end_token_id:
            # keras-hub's samplers stop once every row holds an end token past its
            # prompt, padding included: padding with it would stop at once.
            raise ValueError("`pad_token_id` must differ from `end_token_id`. Received: "
                             f"pad_token_id={pad_token_id}, end_token_id={self.end_token_id}")
        self.pad_token_id = int(pad_token_id)
        self.file_assets = [TOKENIZER_FILE]
        self._tokenizer = None
        # No weights to build; built, so that Model.quantize, which visits every
        # leaf layer of a CausalLM (its preprocessor's too), can pass over it.
        self.built = True
        if vocabulary is not None:
            self.set_vocabulary(vocabulary)

    # ---- vocabulary ----------------------------------------------------
    def set_vocabulary(self, vocabulary):
        """Set the tokenizer from tokenizer.json text or a path to the file."""
        from tokenizers import Tokenizer as HFTokenizer

        if not isinstance(vocabulary, str):
            raise ValueError("`vocabulary` must be tokenizer.json text or a path to it. "
                             f"Received: {type(vocabulary).__name__}")
        if vocabulary.lstrip().startswith("{"):
            self._tokenizer = check_tokenizer_text(vocabulary, "`vocabulary`", HFTokenizer)
        elif os.path.isfile(vocabulary):
            self._tokenizer = read_tokenizer_json(vocabulary)
        else:
            raise ValueError("`vocabulary` must be tokenizer.json text or a path to it. "
                             f"Received: vocabulary={vocabulary[:80]!r}")
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        for name in ("start_token_id", "end_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and value >= size:
                raise ValueError(f"`{name}` must be below the vocabulary size {size}. "
                                 f"Received: {name}={value}")

    def save_assets(self, dir_path):
        with open(os.path.join(dir_path, TOKENIZER_FILE), "w", encoding="utf-8") as f:
            f.write(self._hf().to_str())

    def load_assets(self, dir_path):
        self.set_vocabulary(os.path.join(dir_path, TOKENIZER_FILE))

    def _hf(self):
        if self._tokenizer is None:
            raise ValueError("No vocabulary has been set for DCFormerTokenizer: pass "
                             "`vocabulary` (tokenizer.json) or load it with `from_preset`.")
        return self._tokenizer

    def vocabulary_size(self):
        return self._hf().get_vocab_size(with_added_tokens=True)

    def get_vocabulary(self):
        vocab = self._hf().get_vocab(with_added_tokens=True)
        return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]

    def id_to_token(self, id):
        token = self._hf().id_to_token(int(id))
        if token is None:
            raise ValueError(f"`id` must be in [0, {self.vocabulary_size()}). Received: id={id}")
        return token

    def token_to_id(self, token):
        id = self._hf().token_to_id(token)
        if id is None:
            raise ValueError(f"Token {token!r} is not in the vocabulary.")
        return id

    @property
    def special_token_ids(self):
        return sorted({i for i in (self.start_token_id, self.end_token_id, self.pad_token_id)
                       if i is not None})

    # ---- tokenize / detokenize -----------------------------------------
    def _encode(self, texts):
        return [e.ids for e in self._hf().encode_batch(list(texts), add_special_tokens=False)]

    def _decode(self, ids):
        return self._hf().decode_batch([list(map(int, row)) for row in ids],
                                       skip_special_tokens=False)

    def _tokenize_python(self, inputs):
        texts, batched, outer_shape = canonicalize_python_string_inputs(inputs)
        if outer_shape is not None:
            raise ValueError("`inputs` must be a string or a 1-D batch of strings. "
                             f"Received: inputs of shape {outer_shape}")
        ids = self._encode(texts)
        return ids if batched else np.asarray(ids[0], dtype="int32")

    @preprocessing_function
    def _tokenize_tf(self, inputs):
        # Inside tf.data / tf.function: the encoder is Python, so it runs as a
        # py_function returning the flat ids and each row's length.
        inputs = tf.convert_to_tensor(inputs)
        scalar = inputs.shape.rank == 0

        def encode(strings):
            ids = self._encode(s.decode("utf-8") for s in strings.numpy())
            flat = np.asarray([i for row in ids for i in row], dtype="int32")
            return flat, np.asarray([len(row) for row in ids], dtype="int64")

        flat, lengths = tf.py_function(encode, [tf.reshape(inputs, [-1])],
                                       [tf.int32, tf.int64])
        flat.set_shape([None])
        lengths.set_shape([None])
        ragged = tf.RaggedTensor.from_row_lengths(flat, lengths)
        return ragged[0] if scalar else ragged

    def tokenize(self, inputs):
        if self._use_tf_workflow():
            return self._tokenize_tf(inputs)
        return self._tokenize_python(inputs)

    def _detokenize_python(self, inputs):
        ids, batched = canonicalize_python_token_inputs(inputs)
        out = self._decode(ids)
        return out if batched else out[0]

    @preprocessing_function
    def _detokenize_tf(self, inputs):
        if not isinstance(inputs, tf.RaggedTensor):
            inputs = tf.convert_to_tensor(inputs)
        unbatched = inputs.shape.rank == 1
        if unbatched:
            inputs = tf.expand_dims(inputs, 0)
        if not isinstance(inputs, tf.RaggedTensor):
            inputs = tf.RaggedTensor.from_tensor(inputs)

        def decode(flat, lengths):
            flat, lengths = flat.numpy(), lengths.numpy()
            rows = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
            return np.asarray([s.encode("utf-8") for s in self._decode(rows)], dtype=object)

        out = tf.py_function(decode, [tf.cast(inputs.flat_values, tf.int32),
                                      inputs.row_lengths()], tf.string)
        out.set_shape([None])
        return out[0] if unbatched else out

    def detokenize(self, inputs):
        if self._use_tf_workflow():
            return self._detokenize_tf(inputs)
        return self._detokenize_python(inputs)

    def call(self, inputs, *args, training=None, **kwargs):
        return self.tokenize(inputs, *args, **kwargs)

    def get_config(self):
        return {**super().get_config(), "start_token_id": self.start_token_id,
                "end_token_id": self.end_token_id, "pad_token_id": self.pad_token_id}

    @classmethod
    def from_preset(cls, preset, config_file="tokenizer.json", **kwargs):
        """A keras-hub preset, or a release-layout directory / ``hf://`` handle
        (its tokenizer.json; bos/eos/pad ids from its config.json)."""
        directory = release_dir(preset)
        if directory is None:
            return super().from_preset(preset, config_file=config_file, **kwargs)
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"{directory} has no {TOKENIZER_FILE}.")
        config = read_official_config(directory)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = config.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise ValueError(f"config.json: {key!r} must be null or a non-negative "
                                 f"integer. Received: {short(value)}")
        pad = config.get("pad_token_id")
        ids = dict(start_token_id=config.get("bos_token_id"),
                   end_token_id=config.get("eos_token_id"),
                   # Hugging Face configs often pad with eos, which keras-hub cannot.
                   pad_token_id=None if pad == config.get("eos_token_id") else pad)
        return cls(vocabulary=path, **{**ids, **kwargs})
