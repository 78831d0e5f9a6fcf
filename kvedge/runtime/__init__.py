"""The runtime: loads exported artifacts, owns the preallocated KV cache, generates. No torch."""
