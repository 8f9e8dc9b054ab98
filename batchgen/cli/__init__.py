"""The `batchgen` command.

Exit codes: 0 done (rows that failed are in the output with finish_reason "error"), 2 usage error,
65 some rows failed and --strict was given, 75 interrupted (SIGTERM/SIGINT; rerun to resume),
1 any other failure.
"""

from __future__ import annotations

import signal
import sys

import typer

from batchgen.cli import bench, models, queue, run
from batchgen.cli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, _ClickException, _UsageError
from batchgen.extras import EXTRA_OF, MissingExtra
from batchgen.interrupts import Interrupted, interrupt, reset


class BatchgenApp(typer.Typer):
    """Typer, with usage errors as one line on stderr (exit 2) instead of a boxed panel."""

    def __call__(self, args: list[str] | None = None, prog_name: str = "batchgen") -> None:
        # From here on, before the heavy imports and the default model's conversion, SIGTERM/SIGINT
        # unwind the command (the conversion removes its directory) and it exits 75; a command that
        # has something to finish installs its own handlers (_Signals, the worker's).
        reset()
        previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._main(args, prog_name)
        except Interrupted as e:
            print(f"{prog_name}: {e}: interrupted; rerun the same command to go on", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _main(self, args: list[str] | None, prog_name: str) -> None:
        command = typer.main.get_command(self)
        try:
            code = command.main(args=args, prog_name=prog_name, standalone_mode=False)
        except _UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":
                e.show()  # prints the command's help
                sys.exit(EXIT_USAGE)
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            print(f"{prog_name}: error: {' '.join(e.format_message().split())}{hint}", file=sys.stderr)
            code = EXIT_USAGE
        except _ClickException as e:
            print(f"{prog_name}: error: {e.format_message()}", file=sys.stderr)
            code = e.exit_code
        except ModuleNotFoundError as e:  # an optional extra (redis, xgrammar, ...) is not installed
            if e.name not in EXTRA_OF:
                raise
            print(f"{prog_name}: error: {MissingExtra(e.name)}", file=sys.stderr)
            code = EXIT_FAILURE
        except typer.Abort:
            code = EXIT_INTERRUPTED
        sys.exit(code if isinstance(code, int) else EXIT_OK)


app = BatchgenApp(
    name="batchgen",
    help="Offline batch LLM generation: Parquet/JSONL prompts in, Parquet results with per-request metrics out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)

# The commands, in the order `batchgen --help` lists them.
app.command(no_args_is_help=True)(run.run)
app.command(no_args_is_help=True)(queue.submit)
app.command()(queue.worker)
app.command(no_args_is_help=True)(queue.collect)
app.command()(models.models)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})(
    bench.bench)
