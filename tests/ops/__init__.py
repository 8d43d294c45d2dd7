"""The functional core (dcmha.ops) and what it stands on: dcmha.call, the registry's dispatch, the framework seam (dcmha.framework)."""
