"""Transfer (DESIGN.md §17): a request as a chain of chunks, its branches per step, the chunk tensors, the
packing of its GEN branches, the derived controls. Imports the base kinds (denoise, samplers) beside it."""
