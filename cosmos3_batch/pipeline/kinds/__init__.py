"""What one request does at each step, one module (or room) per kind: the base denoise job and its samplers
and streams, Transfer's chunk chain (transfer/), the step cache (step_cache/), the model they compute with.
Imports no other room of pipeline/; transfer/ may import the flat modules here, and they step_cache/."""
