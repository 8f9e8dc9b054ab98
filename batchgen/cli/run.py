"""`batchgen run`: one file job, INPUT to OUTPUT, on this machine."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from batchgen.cli.engine_setup import _engine_setup
from batchgen.cli.errors import EXIT_INTERRUPTED, EXIT_ROW_ERRORS, EXIT_USAGE, _BadSetting, _fail, _unexpected
from batchgen.cli.files import _check_input, _formats, _served_models
from batchgen.cli.options import (
    ENGINE_OPTIONS,
    JOB,
    OPENAI,
    SAMPLING_OPTIONS,
    InputFormat,
    OutputFormat,
    _env,
    _with_options,
    file_path,
    input_format_option,
    served_model_name_option,
)
from batchgen.cli.signals import _Signals


@_with_options(ENGINE_OPTIONS, SAMPLING_OPTIONS)
def run(
    input: Path = typer.Argument(..., help="Prompts: a .jsonl file (one JSON object a line) or a .parquet file.",
                                 show_default=False, parser=file_path, metavar="INPUT"),
    output: Path = typer.Argument(..., help="Results: a Parquet file (or, named *.jsonl, an OpenAI batch output "
                                            "file), written when the job completes.", show_default=False,
                                  parser=file_path, metavar="OUTPUT"),
    shard: Optional[str] = typer.Option(None, "--shard", envvar=_env("SHARD"), rich_help_panel=JOB, metavar="I/N",
                                        help="Generate only rows whose index % N == I (0 <= I < N)."),
    resume: bool = typer.Option(True, "--resume/--no-resume", envvar=_env("RESUME"), rich_help_panel=JOB,
                                help="Continue from the rows an interrupted run left in OUTPUT.partial/, "
                                     "or (--no-resume) discard them and start over."),
    overwrite: bool = typer.Option(False, "--overwrite", envvar=_env("OVERWRITE"), rich_help_panel=JOB,
                                   help="Replace an OUTPUT that is not this job's finished output (another "
                                        "run's, with other settings, or not batchgen's); without it such an "
                                        "OUTPUT is refused."),
    strict: bool = typer.Option(False, "--strict", envvar=_env("STRICT"), rich_help_panel=JOB,
                                help="Exit 65 if any row failed."),
    flush_rows: int = typer.Option(1000, "--flush-rows", envvar=_env("FLUSH_ROWS"), rich_help_panel=JOB, min=1,
                                   help="Save finished rows to OUTPUT.partial/ every this many rows ..."),
    flush_seconds: float = typer.Option(5.0, "--flush-seconds", envvar=_env("FLUSH_SECONDS"), rich_help_panel=JOB,
                                        min=0.0, help="... or every this many seconds."),
    log_every: float = typer.Option(10.0, "--log-every", envvar=_env("LOG_EVERY"), rich_help_panel=JOB, min=0.0,
                                    help="Seconds between progress lines when stdout is not a terminal."),
    input_format: InputFormat = input_format_option(
        "openai: INPUT is an OpenAI batch file ({custom_id, method, url, body} lines); auto: told by its first line."),
    output_format: OutputFormat = typer.Option(OutputFormat.auto, "--output-format", envvar=_env("OUTPUT_FORMAT"),
                                               rich_help_panel=OPENAI,
                                               help="openai: the OpenAI batch output file (JSONL); "
                                                    "auto: openai for an OUTPUT named *.jsonl, else parquet."),
    served_model_name: Optional[list[str]] = served_model_name_option(
        "The model name OpenAI lines may give in body.model (repeat for several; the first is reported). "
        "Default: --model, or the default model's name."),
    error_file: Optional[Path] = typer.Option(None, "--error-file", envvar=_env("ERROR_FILE"), rich_help_panel=OPENAI,
                                              parser=file_path,
                                              help="OpenAI output: write failed lines here instead of into OUTPUT."),
    options: dict = None,
) -> None:
    """Generate a completion for every row of INPUT and write them, with per-request metrics, to OUTPUT.

    Rows that cannot be generated (bad JSON, no prompt, prompt too long, ...) are written with
    finish_reason "error" and an error message; the job goes on. Every option also reads the
    environment variable shown.
    """
    started = time.monotonic()
    from batchgen.io import InputError, JobError, JobSpec, Shard, run_job

    try:
        job_shard = Shard.parse(shard)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="'--shard'") from None
    _check_input(input)
    if output.resolve() == input.resolve():
        raise typer.BadParameter("OUTPUT would overwrite INPUT", param_hint="'OUTPUT'")
    formats = _formats(input, output, input_format, output_format, error_file)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        stream=sys.stderr)  # before the setup, which may convert the default model (logged)
    setup = _engine_setup(options)
    spec = JobSpec(input=input, output=output, settings=setup.settings, shard=job_shard, resume=resume,
                   overwrite=overwrite, flush_rows=flush_rows, flush_seconds=flush_seconds, described=setup.described,
                   served_models=_served_models(served_model_name, options["model"]), **formats)

    console = Console(highlight=False, soft_wrap=True, markup=False)
    from batchgen.progress import make_progress, summary_lines

    stop_event = threading.Event()
    try:
        with _Signals(stop_event) as signals:
            result = run_job(spec, setup.make_llm, setup.sampling, stop_event, make_progress(console, log_every),
                             on_generation=signals.on_generation, started=started)
    except _BadSetting as e:
        raise _fail(str(e), EXIT_USAGE) from None
    except (JobError, InputError) as e:
        raise _fail(str(e)) from None
    except KeyboardInterrupt:
        print(f"batchgen: interrupted; finished rows are kept in {output}.partial/: "
              f"rerun the same command to resume", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        raise _unexpected(e) from None

    if result.status == "interrupted":
        console.print(f"interrupted: {result.rows_this_run} rows finished in this run and kept "
                      f"({result.rows_resumed + result.rows_this_run}/{result.rows_total} in all); "
                      f"rerun the same command to resume")
        raise typer.Exit(EXIT_INTERRUPTED)
    meta = result.metadata
    if result.status == "already_complete":
        console.print(f"{output} is already complete ({meta.get('rows')} rows, {meta.get('rows_error')} errors) "
                      f"with these settings; nothing to do (--no-resume generates it again)")
    else:
        for line in summary_lines(meta, str(output)):
            console.print(line)
    if strict and meta.get("rows_error"):
        print(f"batchgen: {meta['rows_error']} rows failed (--strict)", file=sys.stderr)
        raise typer.Exit(EXIT_ROW_ERRORS)
