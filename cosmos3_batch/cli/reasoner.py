"""`--max-reason-active` and `--und-resident` (DESIGN.md §21) as options of `run` and `plan` (their help; the
defaults are decided by plan/reason_memory.py, for `run` at its start, for `plan` for --device-gib)."""

from __future__ import annotations

from typing import Annotated

import typer

from cosmos3_batch.plan.reason_memory import CPU_REASON_SLOTS, MAX_REASON_SLOTS

MAX_REASON_HELP = (
    "Reasoner requests (a `reason` object) decoded together per process, in slots of their own beside the "
    "--max-active slots of generation requests (an upsampling, caption or score rides its request's): they "
    "share every UND fetch, one token each a pass, and a full pool never holds up the other's admissions. "
    "Default: the device memory left after plan's device estimate (of 90%: 10% stays in reserve) over one "
    "sequence's K/V (its prompt, vision and max_new_tokens tokens), less --prefill-lookahead, between 1 and "
    f"{MAX_REASON_SLOTS}; {CPU_REASON_SLOTS} on the CPU device. summary.json and `plan` say what was taken "
    "and why."
)
UND_RESIDENT_HELP = (
    "Keep every layer's UND half on the device and stream only GEN parts: reasoner decoding moves no UND "
    "bytes per token. Default: on for a job with reasoner decoding (reasoner requests, upsample, caption, "
    "score) when plan's device estimate with the UND half fits 90% of the device's memory, else off (off on "
    "the CPU device, and with --offload resident); either flag forces it. summary.json and `plan` say which "
    "was taken and why."
)
PLAN_SUFFIX = " `plan`: as `run` decides it, for a device of --device-gib."

MaxReasonActive = Annotated[int | None, typer.Option(help=MAX_REASON_HELP, show_default=False)]
UndResident = Annotated[
    bool | None, typer.Option("--und-resident/--no-und-resident", help=UND_RESIDENT_HELP, show_default=False)
]
PlanMaxReasonActive = Annotated[
    int | None, typer.Option(help=MAX_REASON_HELP + PLAN_SUFFIX, show_default=False)
]
PlanUndResident = Annotated[
    bool | None,
    typer.Option(
        "--und-resident/--no-und-resident", help=UND_RESIDENT_HELP + PLAN_SUFFIX, show_default=False
    ),
]
