"""keras.distribution, dcmha.distribution and dcmha.engines (8 virtual CPU devices in subprocesses)."""
