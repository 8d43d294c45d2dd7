"""DCFormerLM (dcmha.models): forward, decoding, generation, optimizers, saving; the demo and the quality tool."""
