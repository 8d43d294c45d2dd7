"""dcmha.hub through keras-hub (its own process per backend: keras-hub imports TensorFlow)."""
