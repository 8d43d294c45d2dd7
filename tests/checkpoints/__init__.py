"""dcmha.checkpoints: official state dicts and release-layout directories."""
