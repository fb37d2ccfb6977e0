"""`python -m cosmos3_batch` (what torchrun starts on every rank) and the `cosmos3-batch` script."""

from cosmos3_batch.startup import pause_collection


def main() -> None:
    pause_collection()  # before the CLI's imports (torch among them): startup.py says why
    from cosmos3_batch.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
