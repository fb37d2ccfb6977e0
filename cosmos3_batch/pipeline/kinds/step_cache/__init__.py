"""`--cache sea` (DESIGN.md §19): a request's step cache, diffusers' SeaCache gate cut at its host read, and
the spectral indicator without a host read. Imports nothing else of pipeline/."""
