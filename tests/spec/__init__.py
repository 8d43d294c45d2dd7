"""The NumPy spec (dcmha.spec), its tolerance policy, the conformance suite (dcmha.conformance) and untrusted inputs."""
