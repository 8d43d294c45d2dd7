"""The DCMHA layer (dcmha.layers): API, numerics against the spec, decoding, training, validation, determinism."""
