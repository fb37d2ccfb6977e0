"""The command line (typer): `app.py` has `run`, `plan`, `make-tiny` and `convert`; `data.py` the commands
over a run's output folder (`report`, `status`, `manifest`, `export lerobot`) and `run`'s dataset flags.
Parse -> config -> call: no logic lives here."""

from cosmos3_batch.cli.app import app, main

__all__ = ["app", "main"]
