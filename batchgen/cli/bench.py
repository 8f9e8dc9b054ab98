"""`batchgen bench`: the throughput benchmark of a source checkout."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from batchgen.cli.errors import EXIT_USAGE, _fail


def bench(ctx: typer.Context) -> None:
    """Throughput benchmark on a GPU: benchmarks/throughput.py's workloads, batchgen against HF generate() in the
    same run (benchmarks/throughput.py; every argument passes through, `batchgen bench --help` lists them)."""
    import runpy

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"
    if not script.exists():
        raise _fail("batchgen bench runs benchmarks/throughput.py of a source checkout; none is next to this install",
                    EXIT_USAGE)
    sys.argv = [str(script), *ctx.args]
    runpy.run_path(str(script), run_name="__main__")
