"""`python -m batchgen.cli`: the `batchgen` command."""

from batchgen.cli import app

if __name__ == "__main__":
    app()
