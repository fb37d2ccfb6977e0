"""One `run` (DESIGN.md §3), in four rooms, each importing only the rooms below it:

    job/      the run from start to end: validate, plan everywhere, load, drive the passes, end, resume
    passes/   the pass loop and its collectives: the runner, the per-pass exchange, part application, layer
              weights, the live monitor
    finish/   after the last step: the finisher thread, the VAE team, the files and rows a result leaves
    kinds/    what one request does per step: the base denoise job, Transfer's chain, samplers, the step cache

A new request kind is a module in kinds/ that answers the questions the runner asks every kind; a new
output stage is a module in finish/; a new cache is a room in kinds/ beside step_cache/.
"""
