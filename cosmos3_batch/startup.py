"""A job process's start: Python's cyclic garbage collector paused while it imports its libraries, their
objects then frozen out of the collector's reach (`gc.freeze`).

Importing torch, diffusers and transformers allocates enough objects to set off several full collections,
each walking everything imported so far; those objects live as long as the process, so walking them finds
nothing. Frozen, they are not walked again either: a full collection in the pass loop (where a pause on one
rank holds every rank at the next collective) walks only what the job itself made. Measured figures:
docs/testing.md "The collector".

`python -m cosmos3_batch` and the `cosmos3-batch` script pause at entry; `run` resumes once its job has
validated and planned and imported the classes its load builds (pipeline/job/run.py), every other command at
its start (cli/app.py). A program that imports the CLI and calls it (a test runner) keeps its collector as it
was. What cyclic garbage the paused imports left is frozen with them: once, and small.
"""

from __future__ import annotations

import gc

_paused = False


def pause_collection() -> None:
    """At process entry, before the first heavy import."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def imports_done() -> None:
    """After the imports: freeze what they made and collect again as usual (a no-op unless
    `pause_collection` paused it, so a second call does nothing)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
