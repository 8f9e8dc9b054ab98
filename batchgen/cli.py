"""The `batchgen` command.

Exit codes: 0 done (rows that failed are in the output with finish_reason "error"), 2 usage error,
65 some rows failed and --strict was given, 75 interrupted (SIGTERM/SIGINT; rerun to resume),
1 any other failure.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_ROW_ERRORS, EXIT_INTERRUPTED = 0, 1, 2, 65, 75

# Click's exception classes, wherever this Typer keeps them (newer Typers vendor their own Click).
_ClickException, _UsageError = (
    next(c for c in typer.BadParameter.__mro__ if c.__name__ == name) for name in ("ClickException", "UsageError")
)


class BatchgenApp(typer.Typer):
    """Typer, with usage errors as one line on stderr (exit 2) instead of a boxed panel."""

    def __call__(self, args: list[str] | None = None, prog_name: str = "batchgen") -> None:
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


class Dtype(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


def _env(name: str) -> str:
    return f"BATCHGEN_{name}"


ENGINE = "Engine"
SAMPLING = "Sampling defaults (per-row columns override them)"
JOB = "Job"


def _fail(message: str, code: int = EXIT_FAILURE) -> typer.Exit:
    print(f"batchgen: error: {' '.join(str(message).split())}", file=sys.stderr)
    return typer.Exit(code)


class _Signals:
    """SIGTERM/SIGINT: while the engine generates, the first one sets `stop_event` (the engine stops
    within a step, finished rows are saved, exit 75); at any other time, or the second time, it
    interrupts at once (KeyboardInterrupt; finished rows are still saved)."""

    def __init__(self, stop_event: threading.Event) -> None:
        self.stop_event = stop_event
        self.generating = False
        self._previous: dict = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def on_generation(self, active: bool) -> None:
        self.generating = active

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.generating and not self.stop_event.is_set():
            self.stop_event.set()
            print(f"batchgen: {name}: stopping; finished rows are kept (send it again to stop at once)", file=sys.stderr)
            return
        raise KeyboardInterrupt


@app.command(no_args_is_help=True)
def run(
    input: Path = typer.Argument(..., help="Prompts: a .jsonl file (one JSON object a line) or a .parquet file.",
                                 show_default=False),
    output: Path = typer.Argument(..., help="Results: a Parquet file, written when the job completes.",
                                  show_default=False),
    model: Optional[str] = typer.Option(None, "--model", envvar=_env("MODEL"), rich_help_panel=ENGINE,
                                        help="Local HF model directory (or hub id where a hub is reachable). "
                                             "Default: the embedded SmolLM2-135M-Instruct."),
    dtype: Dtype = typer.Option(Dtype.auto, "--dtype", envvar=_env("DTYPE"), rich_help_panel=ENGINE,
                                help="Weights and activations dtype; auto: the checkpoint's on CUDA, float32 on CPU."),
    device: Device = typer.Option(Device.auto, "--device", envvar=_env("DEVICE"), rich_help_panel=ENGINE,
                                  help="auto: CUDA if available, else CPU."),
    tensor_parallel_size: int = typer.Option(1, "-tp", "--tensor-parallel-size", envvar=_env("TENSOR_PARALLEL_SIZE"),
                                             rich_help_panel=ENGINE, help="GPUs to split the model over."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", envvar=_env("MAX_NUM_SEQS"), rich_help_panel=ENGINE,
                                     help="Most sequences in one batch."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens",
                                                         envvar=_env("MAX_NUM_BATCHED_TOKENS"), rich_help_panel=ENGINE,
                                                         help="Token budget of one step (prefill chunks + decodes). "
                                                              "Default: chosen by the engine."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", envvar=_env("GPU_MEMORY_UTILIZATION"),
                                                 rich_help_panel=ENGINE, help="Share of GPU memory the engine may use."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", envvar=_env("MAX_MODEL_LEN"),
                                                rich_help_panel=ENGINE,
                                                help="Longest prompt + output, in tokens. Default: the model's."),
    kv_cache_tokens: Optional[int] = typer.Option(None, "--kv-cache-tokens", envvar=_env("KV_CACHE_TOKENS"),
                                                  rich_help_panel=ENGINE,
                                                  help="KV cache size in tokens. Default: from the memory budget."),
    max_tokens: int = typer.Option(256, "--max-tokens", envvar=_env("MAX_TOKENS"), rich_help_panel=SAMPLING,
                                   help="Most tokens to generate for a row."),
    min_tokens: int = typer.Option(0, "--min-tokens", envvar=_env("MIN_TOKENS"), rich_help_panel=SAMPLING,
                                   help="Fewest tokens to generate before EOS or a stop may end a row."),
    temperature: float = typer.Option(1.0, "--temperature", envvar=_env("TEMPERATURE"), rich_help_panel=SAMPLING,
                                      help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", envvar=_env("TOP_P"), rich_help_panel=SAMPLING),
    top_k: int = typer.Option(-1, "--top-k", envvar=_env("TOP_K"), rich_help_panel=SAMPLING, help="-1 or 0 = off."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", envvar=_env("STOP"), rich_help_panel=SAMPLING,
                                             help="A stop string (repeat for several)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", envvar=_env("IGNORE_EOS"), rich_help_panel=SAMPLING,
                                    help="Generate past EOS, up to --max-tokens."),
    seed: int = typer.Option(0, "--seed", envvar=_env("SEED"), rich_help_panel=SAMPLING,
                             help="Job seed: a row without its own seed gets one derived from (seed, id)."),
    shard: Optional[str] = typer.Option(None, "--shard", envvar=_env("SHARD"), rich_help_panel=JOB, metavar="I/N",
                                        help="Generate only rows whose index % N == I (0 <= I < N)."),
    resume: bool = typer.Option(True, "--resume/--no-resume", envvar=_env("RESUME"), rich_help_panel=JOB,
                                help="Continue from the rows an interrupted run left in OUTPUT.partial/, "
                                     "or (--no-resume) discard them and start over."),
    strict: bool = typer.Option(False, "--strict", envvar=_env("STRICT"), rich_help_panel=JOB,
                                help="Exit 65 if any row failed."),
    flush_rows: int = typer.Option(1000, "--flush-rows", envvar=_env("FLUSH_ROWS"), rich_help_panel=JOB, min=1,
                                   help="Save finished rows to OUTPUT.partial/ every this many rows ..."),
    flush_seconds: float = typer.Option(5.0, "--flush-seconds", envvar=_env("FLUSH_SECONDS"), rich_help_panel=JOB,
                                        min=0.0, help="... or every this many seconds."),
    log_every: float = typer.Option(10.0, "--log-every", envvar=_env("LOG_EVERY"), rich_help_panel=JOB, min=0.0,
                                    help="Seconds between progress lines when stdout is not a terminal."),
) -> None:
    """Generate a completion for every row of INPUT and write them, with per-request metrics, to OUTPUT.

    Rows that cannot be generated (bad JSON, no prompt, prompt too long, ...) are written with
    finish_reason "error" and an error message; the job goes on. Every option also reads the
    environment variable shown.
    """
    started = time.monotonic()
    from batchgen.io import InputError, JobError, JobSpec, Shard, run_job
    from batchgen.io.sources import JSONL_SUFFIXES, PARQUET_SUFFIXES

    try:
        job_shard = Shard.parse(shard)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="'--shard'") from None
    if not input.is_file():
        raise typer.BadParameter(f"{str(input)!r} is not a file", param_hint="'INPUT'")
    if input.suffix.lower() not in (*JSONL_SUFFIXES, *PARQUET_SUFFIXES):
        raise typer.BadParameter(f"{str(input)!r}: name it *.jsonl or *.parquet", param_hint="'INPUT'")
    if output.resolve() == input.resolve():
        raise typer.BadParameter("OUTPUT would overwrite INPUT", param_hint="'OUTPUT'")

    from batchgen import LLM, EngineConfig, SamplingParams

    try:
        sampling = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, stop=list(stop or []), ignore_eos=ignore_eos)
    except ValueError as e:
        raise _UsageError(f"invalid sampling default: {e}") from None
    engine_options = dict(
        dtype=dtype.value, device=device.value, tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len, kv_cache_tokens=kv_cache_tokens, seed=seed,
    )
    try:
        EngineConfig(model=model, **engine_options)
    except ValueError as e:
        raise _UsageError(str(e)) from None

    # What shapes the output: a leftover written with other values of these is not resumed.
    settings = {
        "model": model or "default", "dtype": dtype.value, "device": device.value, "max_model_len": max_model_len,
        "kv_cache_tokens": kv_cache_tokens, "seed": seed, "max_tokens": max_tokens, "min_tokens": min_tokens,
        "temperature": temperature, "top_p": top_p, "top_k": sampling.top_k, "stop": sampling.stop,
        "ignore_eos": ignore_eos,
    }
    spec = JobSpec(input=input, output=output, settings=settings, shard=job_shard, resume=resume,
                   flush_rows=flush_rows, flush_seconds=flush_seconds)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        stream=sys.stderr)
    console = Console(highlight=False, soft_wrap=True, markup=False)
    from batchgen.progress import make_progress, summary_lines

    def make_llm():
        try:
            return LLM(model=model, **engine_options)
        except (ValueError, FileNotFoundError) as e:
            raise _BadSetting(str(e)) from None

    stop_event = threading.Event()
    try:
        with _Signals(stop_event) as signals:
            result = run_job(spec, make_llm, sampling, stop_event, make_progress(console, log_every),
                             on_generation=signals.on_generation, started=started)
    except _BadSetting as e:
        raise _fail(str(e), EXIT_USAGE) from None
    except (JobError, InputError) as e:
        raise _fail(str(e)) from None
    except KeyboardInterrupt:
        print(f"batchgen: interrupted; finished rows are kept in {output}.partial/: "
              f"rerun the same command to resume", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:  # a bug, or the machine ran out of something: one line, traceback on request
        if os.environ.get("BATCHGEN_DEBUG"):
            raise
        raise _fail(f"{type(e).__name__}: {e} (set BATCHGEN_DEBUG=1 for the traceback)") from None

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


class _BadSetting(Exception):
    """An engine option the engine refused (ValueError) or a model it could not find."""


@app.command()
def models() -> None:
    """Show the embedded default model and where its converted copy is cached."""
    from batchgen.models import default_model

    target = default_model.default_model_dir()
    try:
        gguf = str(default_model.gguf_path())
    except FileNotFoundError as e:
        gguf = f"missing: {e}"
    converted = (target / "config.json").exists()
    print(f"default model: {default_model.DEFAULT_MODEL_NAME} (used when --model is not given)")
    print(f"source:        {gguf}")
    print(f"cache:         {target} ({'converted' if converted else 'not converted yet: the first run converts it'})")
    print("other models:  --model PATH (a local Hugging Face model directory)")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def bench(ctx: typer.Context) -> None:
    """Throughput benchmark on a GPU: BENCHMARKS.md's workloads, batchgen against HF generate() in the
    same run (benchmarks/throughput.py; every argument passes through, `batchgen bench --help` lists them)."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"
    if not script.exists():
        raise _fail("batchgen bench runs benchmarks/throughput.py of a source checkout; none is next to this install",
                    EXIT_USAGE)
    sys.argv = [str(script), *ctx.args]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    app()
