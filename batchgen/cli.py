"""The `batchgen` command.

Exit codes: 0 done (rows that failed are in the output with finish_reason "error"), 2 usage error,
65 some rows failed and --strict was given, 75 interrupted (SIGTERM/SIGINT; rerun to resume),
1 any other failure.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

from batchgen.config import debug
from batchgen.extras import EXTRA_OF, MissingExtra
from batchgen.schema import INT32_MAX, FieldError, check_range

if TYPE_CHECKING:  # the engine's imports (torch) wait until a command needs them
    from batchgen import SamplingParams

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_ROW_ERRORS, EXIT_INTERRUPTED = 0, 1, 2, 65, 75

# Click's exception classes, wherever this Typer keeps them (newer Typers vendor their own Click).
_ClickException, _UsageError = (
    next(c for c in typer.BadParameter.__mro__ if c.__name__ == name) for name in ("ClickException", "UsageError")
)


class _Interrupted(BaseException):
    """SIGTERM/SIGINT where no command handler took it. Not a KeyboardInterrupt, which Typer would
    turn into exit 130 on its way out."""


def _interrupt(signum, frame) -> None:
    raise _Interrupted(signal.Signals(signum).name)


class BatchgenApp(typer.Typer):
    """Typer, with usage errors as one line on stderr (exit 2) instead of a boxed panel."""

    def __call__(self, args: list[str] | None = None, prog_name: str = "batchgen") -> None:
        # From here on, before the heavy imports and the default model's conversion, SIGTERM/SIGINT
        # unwind the command (the conversion removes its directory) and it exits 75; a command that
        # has something to finish installs its own handlers (_Signals, the worker's).
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._main(args, prog_name)
        except _Interrupted as e:
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


class Dtype(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class InputFormat(str, Enum):
    auto = "auto"
    openai = "openai"
    batchgen = "batchgen"


class OutputFormat(str, Enum):
    auto = "auto"
    parquet = "parquet"
    openai = "openai"


class KvCacheDtype(str, Enum):
    auto = "auto"
    fp8 = "fp8"
    fp8_e4m3 = "fp8_e4m3"


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class GenerationConfig(str, Enum):
    auto = "auto"  # sampling defaults not given as options: the model's generation_config.json, else built-in
    none = "none"  # batchgen's built-ins


def _env(name: str) -> str:
    return f"BATCHGEN_{name}"


ENGINE = "Engine"
SAMPLING = "Sampling defaults (per-row columns override them)"
JOB = "Job"
OPENAI = "OpenAI Batch API files"
QUEUE = "Queue"


def _fail(message: str, code: int = EXIT_FAILURE) -> typer.Exit:
    print(f"batchgen: error: {' '.join(str(message).split())}", file=sys.stderr)
    return typer.Exit(code)


def _unexpected(error: Exception) -> typer.Exit:
    """A failure no command foresaw (a bug, or the machine ran out of something): one line, as every
    other error; the traceback with BATCHGEN_DEBUG=1."""
    if debug():
        raise error
    return _fail(f"{type(error).__name__}: {error} (set BATCHGEN_DEBUG=1 for the traceback)")


class _Signals:
    """SIGTERM/SIGINT: while the engine generates, the first one sets `stop_event` (the engine stops
    within a step, finished rows are saved, exit 75); at any other time, or the second time, it
    interrupts at once (KeyboardInterrupt; finished rows are still saved)."""

    def __init__(self, stop_event: threading.Event) -> None:
        self.stop_event = stop_event
        self.generating = False
        self._previous: dict = {}

    def __enter__(self) -> _Signals:
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
            print(f"batchgen: {name}: stopping; finished rows are kept (send it again to stop at once)",
                  file=sys.stderr)
            return
        raise KeyboardInterrupt


def _option(name: str, annotation, default, *decls: str, panel: str, **kwargs) -> inspect.Parameter:
    """One command-line option that also reads BATCHGEN_<NAME>, as a parameter for `_with_options`."""
    option = typer.Option(default, *(decls or (f"--{name.replace('_', '-')}",)), envvar=_env(name.upper()),
                          rich_help_panel=panel, **kwargs)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _in_range(field: str):
    """A Typer callback: the option's value within schema.INT_RANGES[field], the range a row's field of
    that name has; otherwise a one-line usage error."""
    def check(value):
        if value is not None:
            try:
                check_range(field, value)
            except FieldError as e:
                raise typer.BadParameter(str(e)) from None
        return value

    return check


ENGINE_OPTIONS = (
    _option("model", Optional[str], None, panel=ENGINE,
            help="Local HF model directory (or hub id where a hub is reachable). "
                 "Default: the embedded SmolLM2-135M-Instruct."),
    _option("dtype", Dtype, Dtype.auto, panel=ENGINE,
            help="Weights and activations dtype; auto: the checkpoint's half dtype on CUDA; on CPU bfloat16 "
                 "where the CPU has native bf16, else float32."),
    _option("device", Device, Device.auto, panel=ENGINE, help="auto: CUDA if available, else CPU."),
    _option("tensor_parallel_size", int, 1, "-tp", "--tensor-parallel-size", panel=ENGINE, max=INT32_MAX,
            help="GPUs to split the model over."),
    _option("data_parallel_size", str, "1", "-dp", "--data-parallel-size", panel=ENGINE, metavar="N|auto",
            help="Engine replicas, each on its own GPU (or its own --tensor-parallel-size GPUs), fed from one "
                 "input into one output; auto: every visible GPU. On a CPU the replicas share the cores."),
    _option("max_num_seqs", int, 256, panel=ENGINE, max=INT32_MAX, help="Most sequences in one batch."),
    _option("max_num_batched_tokens", Optional[int], None, panel=ENGINE, max=INT32_MAX,
            help="Token budget of one step (prefill chunks + decodes). Default: chosen by the engine."),
    _option("gpu_memory_utilization", float, 0.9, panel=ENGINE, help="Share of GPU memory the engine may use."),
    _option("max_model_len", Optional[int], None, panel=ENGINE, max=INT32_MAX,
            help="Longest prompt + output, in tokens. Default: the model's."),
    _option("kv_cache_tokens", Optional[int], None, panel=ENGINE, max=INT32_MAX,
            help="KV cache size in tokens. Default: from the memory budget."),
    _option("kv_cache_dtype", KvCacheDtype, KvCacheDtype.auto, panel=ENGINE,
            help="KV cache dtype; auto: the model's. fp8 (= fp8_e4m3): half the bytes of bf16, so twice the "
                 "tokens fit and long decodes read half as much; values are rounded (outputs differ slightly). "
                 "Needs a GPU of compute capability 8.9+ (Ada, Hopper) or the CPU."),
    _option("enable_prefix_caching", bool, True, "--enable-prefix-caching/--no-enable-prefix-caching", panel=ENGINE,
            help="Reuse the KV of prompt prefixes computed before (a shared system prompt, few-shot examples, "
                 "the n samples of a row) instead of computing them again."),
)
# A sampling default not given (None) comes from the model's generation_config.json, else batchgen's built-in.
SAMPLING_OPTIONS = (
    _option("max_tokens", Optional[int], None, panel=SAMPLING, callback=_in_range("max_tokens"),
            help="Most tokens to generate for a row. Default: the model's max_new_tokens, else 256."),
    _option("min_tokens", Optional[int], None, panel=SAMPLING, callback=_in_range("min_tokens"),
            help="Fewest tokens to generate before EOS or a stop may end a row. Default: 0."),
    _option("temperature", Optional[float], None, panel=SAMPLING,
            help="0 = greedy. Default: the model's, else 1.0."),
    _option("top_p", Optional[float], None, panel=SAMPLING, help="Default: the model's, else 1.0."),
    _option("top_k", Optional[int], None, panel=SAMPLING, callback=_in_range("top_k"),
            help="-1 or 0 = off. Default: the model's, else off."),
    _option("stop", Optional[list[str]], None, panel=SAMPLING, help="A stop string (repeat for several)."),
    _option("ignore_eos", bool, False, panel=SAMPLING, help="Generate past EOS, up to --max-tokens."),
    _option("n", int, 1, panel=SAMPLING, callback=_in_range("n"),
            help="Samples of each prompt: n output rows (sample_index 0..n-1), the prompt computed once."),
    _option("seed", int, 0, panel=SAMPLING, callback=_in_range("seed"),
            help="Job seed: a row without its own seed gets one derived from (seed, id)."),
    _option("generation_config", GenerationConfig, GenerationConfig.auto, panel=SAMPLING,
            help="auto: sampling defaults not given as options come from the model's generation_config.json "
                 "(temperature, top_p, top_k, max_new_tokens); none: from batchgen's built-ins."),
    _option("response_format", Optional[str], None, panel=SAMPLING, metavar="JSON",
            help='Constrain every row that has no constraint of its own, OpenAI\'s form: '
                 '\'{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}\' '
                 'or \'{"type": "json_object"}\'.'),
    _option("structured_outputs", Optional[str], None, panel=SAMPLING, metavar="JSON",
            help='Likewise, vLLM\'s form: one of \'{"json": {...}}\', \'{"regex": ...}\', \'{"choice": [...]}\', '
                 '\'{"grammar": EBNF}\'.'),
)
QUEUE_OPTIONS = (
    _option("redis_url", str, ..., panel=QUEUE, show_default=False, metavar="URL",
            help="redis://[user:password@]host[:port][/db], rediss:// for TLS, or unix:///path/to/socket. "
                 "Prefer BATCHGEN_REDIS_URL for a password: the command line is visible to other users."),
    _option("prefix", str, "batchgen", panel=QUEUE, help="Prefix of every Redis key batchgen uses."),
)


def _with_options(*groups: tuple[inspect.Parameter, ...]):
    """Gives a command the shared options of `groups` (after its arguments, before its own options);
    its function receives their values as one dict, `options`."""
    shared = [p for group in groups for p in group]

    def decorate(func):
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "options"]
        arguments = [p for p in own if isinstance(p.default, typer.models.ArgumentInfo)]
        rest = [p for p in own if p not in arguments]
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in arguments] + shared
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in rest]

        @functools.wraps(func)
        def command(**kwargs):
            options = {p.name: kwargs.pop(p.name) for p in shared}
            return func(options=options, **kwargs)

        command.__signature__ = inspect.Signature(params)
        return command

    return decorate


@dataclass
class _EngineSetup:
    model: Optional[str]
    engine_options: dict
    sampling: SamplingParams
    settings: dict  # what shapes the output: resume's fingerprint, a worker's description
    described: dict  # more for the output's metadata: the sampling defaults and where each came from

    def make_llm(self):
        from batchgen import LLM

        try:
            return LLM(model=self.model, **self.engine_options)
        except (ValueError, FileNotFoundError) as e:
            message, tp = str(e), self.engine_options["tensor_parallel_size"]
            if tp != 1 and "tensor-parallel" in message and "--tensor-parallel-size" not in message:
                message = f"invalid --tensor-parallel-size {tp}: {message}"  # the model does not split that way
            raise _BadSetting(message) from None


def _data_parallel_size(value: str) -> int | str:
    text = value.strip().lower()
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise _UsageError(f"invalid --data-parallel-size: {value!r}; give a number >= 1 or auto") from None


def _engine_setup(options: dict) -> _EngineSetup:
    """The engine and sampling options, checked (a bad value is a usage error); the sampling
    defaults resolved: an option given, else the model's generation_config.json, else built-in."""
    from batchgen import EngineConfig
    from batchgen.sampling_params import resolve_defaults

    o = options
    engine_options = dict(
        dtype=o["dtype"].value, device=o["device"].value, tensor_parallel_size=o["tensor_parallel_size"],
        data_parallel_size=_data_parallel_size(o["data_parallel_size"]),
        max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
        gpu_memory_utilization=o["gpu_memory_utilization"], max_model_len=o["max_model_len"],
        kv_cache_tokens=o["kv_cache_tokens"], kv_cache_dtype=o["kv_cache_dtype"].value, seed=o["seed"],
        enable_prefix_caching=o["enable_prefix_caching"], generation_config=o["generation_config"].value,
    )
    try:
        EngineConfig(model=o["model"], **engine_options)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    given = {name: o[name] for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k")}
    given.update(stop=o["stop"] or None, ignore_eos=o["ignore_eos"] or None,  # None: not given
                 n=o["n"] if o["n"] != 1 else None, response_format=o["response_format"],
                 structured_outputs=o["structured_outputs"])
    try:
        sampling, sources = resolve_defaults(given, _model_sampling_defaults(o["model"], o["generation_config"]))
    except ValueError as e:
        message = str(e)
        if message.startswith("both response_format"):
            message = "both --response-format and --structured-outputs given: use one of them"
        for name in ("response_format", "structured_outputs"):  # name them as options
            if message.startswith(name):
                message = "--" + name.replace("_", "-") + message[len(name):]
        hint = "; --generation-config none ignores the model's file" if "generation_config.json" in message else ""
        raise _UsageError(f"invalid sampling default: {message}{hint}") from None
    defaults = {name: getattr(sampling, name) for name in sources}
    settings = {
        "model": o["model"] or "default", "dtype": o["dtype"].value, "device": o["device"].value,
        "max_model_len": o["max_model_len"], "kv_cache_tokens": o["kv_cache_tokens"], "seed": o["seed"],
        "max_tokens": sampling.max_tokens, "min_tokens": sampling.min_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k, "stop": sampling.stop, "ignore_eos": sampling.ignore_eos,
        "generation_config": o["generation_config"].value,
        **({"n": o["n"]} if o["n"] != 1 else {}),  # (absent for n=1: the fingerprints of earlier runs hold)
        **({"kv_cache_dtype": "fp8"} if o["kv_cache_dtype"] != KvCacheDtype.auto else {}),  # (fp8 = fp8_e4m3)
        **({"structured": list(sampling.structured.key)} if sampling.structured is not None else {}),
    }
    # for the output's metadata and the summary: each default's value and where it came from
    described = {"sampling_defaults": defaults, "sampling_defaults_from": sources}
    return _EngineSetup(o["model"], engine_options, sampling, settings, described)


def _model_sampling_defaults(model: Optional[str], generation_config: GenerationConfig) -> dict:
    """The sampling defaults of the model's generation_config.json ({} for --generation-config none).
    Finds the model as the engine will (the default model is converted here on a first run)."""
    if generation_config is GenerationConfig.none:
        return {}
    from batchgen.models.generation_config import read_sampling_defaults
    from batchgen.models.resolve import resolve_model_dir

    try:
        model_dir = resolve_model_dir(model)
    except FileNotFoundError as e:
        raise _fail(str(e), EXIT_USAGE) from None
    try:
        return read_sampling_defaults(model_dir)
    except ValueError as e:
        raise _UsageError(f"{e}; --generation-config none ignores the file") from None


def _check_input(input: Path) -> None:
    from batchgen.io.sources import JSONL_SUFFIXES, PARQUET_SUFFIXES

    if not input.is_file():
        raise typer.BadParameter(f"{str(input)!r} is not a file", param_hint="'INPUT'")
    if input.suffix.lower() not in (*JSONL_SUFFIXES, *PARQUET_SUFFIXES):
        raise typer.BadParameter(f"{str(input)!r}: name it *.jsonl or *.parquet", param_hint="'INPUT'")


def _served_models(names: Optional[list[str]], model: Optional[str]) -> list[str]:
    if names:
        if any(not n for n in names):
            raise typer.BadParameter("a model name cannot be empty", param_hint="'--served-model-name'")
        return list(names)
    from batchgen.models.default_model import DEFAULT_MODEL_NAME

    return [model or DEFAULT_MODEL_NAME]


def _token_text(model: str):
    """A token id -> its text, by the tokenizer of `model` ("default": the embedded model's)."""
    from transformers import AutoTokenizer

    from batchgen.models.resolve import resolve_model_dir
    from batchgen.token_text import token_text_of

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None if model == "default" else model))
    except (OSError, ValueError) as e:  # FileNotFoundError included
        raise typer.BadParameter(" ".join(str(e).split()), param_hint="'--tokenizer'") from None
    return token_text_of(tokenizer)


def _check_input_format(input: Path, input_format: InputFormat) -> None:
    from batchgen.io.sources import JSONL_SUFFIXES

    if input_format is InputFormat.openai and input.suffix.lower() not in JSONL_SUFFIXES:
        raise typer.BadParameter("an OpenAI batch file is JSONL; name it *.jsonl", param_hint="'--input-format'")


def _formats(input: Optional[Path], output: Path, input_format: InputFormat, output_format: OutputFormat,
             error_file: Optional[Path]) -> dict:
    """JobSpec's format fields, checked: auto resolved for the output (the input's needs the file)."""
    from batchgen.io.openai_output import is_openai_output

    if input is not None:
        _check_input_format(input, input_format)
    resolved = output_format.value
    if output_format is OutputFormat.auto:
        resolved = "openai" if is_openai_output(output) else "parquet"
    if error_file is not None:
        if resolved != "openai":
            raise typer.BadParameter("needs the OpenAI output format (--output-format openai or an OUTPUT named "
                                     "*.jsonl)", param_hint="'--error-file'")
        if error_file.resolve() in {output.resolve(), *([input.resolve()] if input is not None else [])}:
            raise typer.BadParameter("must differ from INPUT and OUTPUT", param_hint="'--error-file'")
        if error_file.is_dir():
            raise typer.BadParameter(f"{str(error_file)!r} is a directory", param_hint="'--error-file'")
    return {"input_format": input_format.value, "output_format": resolved, "error_file": error_file}


@app.command(no_args_is_help=True)
@_with_options(ENGINE_OPTIONS, SAMPLING_OPTIONS)
def run(
    input: Path = typer.Argument(..., help="Prompts: a .jsonl file (one JSON object a line) or a .parquet file.",
                                 show_default=False),
    output: Path = typer.Argument(..., help="Results: a Parquet file (or, named *.jsonl, an OpenAI batch output "
                                            "file), written when the job completes.", show_default=False),
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
    input_format: InputFormat = typer.Option(InputFormat.auto, "--input-format", envvar=_env("INPUT_FORMAT"),
                                             rich_help_panel=OPENAI,
                                             help="openai: INPUT is an OpenAI batch file ({custom_id, method, url, "
                                                  "body} lines); auto: told by its first line."),
    output_format: OutputFormat = typer.Option(OutputFormat.auto, "--output-format", envvar=_env("OUTPUT_FORMAT"),
                                               rich_help_panel=OPENAI,
                                               help="openai: the OpenAI batch output file (JSONL); "
                                                    "auto: openai for an OUTPUT named *.jsonl, else parquet."),
    served_model_name: Optional[list[str]] = typer.Option(None, "--served-model-name",
                                                          envvar=_env("SERVED_MODEL_NAME"), rich_help_panel=OPENAI,
                                                          metavar="NAME",
                                                          help="The model name OpenAI lines may give in body.model "
                                                               "(repeat for several; the first is reported). "
                                                               "Default: --model, or the default model's name."),
    error_file: Optional[Path] = typer.Option(None, "--error-file", envvar=_env("ERROR_FILE"), rich_help_panel=OPENAI,
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


class _BadSetting(Exception):
    """An engine option the engine refused (ValueError) or a model it could not find."""


EXIT_TIMEOUT = 124  # collect: not every row had a result in time (as timeout(1) exits)


class LogFormat(str, Enum):
    text = "text"
    json = "json"


def _queue(options: dict, job: Optional[str] = None):
    """-> (Keys, a Redis client) for the queue options; a bad prefix, job name or URL is a usage error."""
    from batchgen.queue import Keys, check_job_name, connect

    try:
        keys = Keys(options["prefix"])
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="'--prefix'") from None
    if job is not None:
        try:
            check_job_name(job)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="'--job'") from None
    try:
        client = connect(options["redis_url"])
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="'--redis-url'") from None
    return keys, client


def _redis_failure(error: Exception, options: dict, what: str) -> typer.Exit:
    """One line for a failed Redis call; `what`: the advice (rerun, ...) unless the server refused
    the credentials, where a rerun cannot help and the fix is in --redis-url or the server's ACL."""
    import redis

    from batchgen.queue import redact
    from batchgen.queue.protocol import FATAL

    if isinstance(error, redis.AuthenticationError):  # wrong password, or none where one is needed
        what = "check the user and password in --redis-url (or BATCHGEN_REDIS_URL)"
    elif isinstance(error, FATAL):
        what = f"give the Redis user access to the keys {options['prefix']}:* and the stream commands (ACL)"
    return _fail(f"redis at {redact(options['redis_url'])}: {type(error).__name__}: {error}; {what}")


JOB_NAME = dict(envvar=_env("JOB"), rich_help_panel=QUEUE, show_default=False, metavar="NAME",
                help="The job's name: up to 200 letters, digits and . _ @ + = - (no ':').")


@app.command(no_args_is_help=True)
@_with_options(QUEUE_OPTIONS)
def submit(
    input: Path = typer.Argument(..., help="Prompts: a .jsonl file (one JSON object a line) or a .parquet file.",
                                 show_default=False),
    job: str = typer.Option(..., "--job", **JOB_NAME),
    input_format: InputFormat = typer.Option(InputFormat.auto, "--input-format", envvar=_env("INPUT_FORMAT"),
                                             rich_help_panel=OPENAI,
                                             help="openai: INPUT is an OpenAI batch file; "
                                                  "auto: told by its first line."),
    served_model_name: Optional[list[str]] = typer.Option(None, "--served-model-name",
                                                          envvar=_env("SERVED_MODEL_NAME"), rich_help_panel=OPENAI,
                                                          metavar="NAME",
                                                          help="The model names OpenAI lines may give in body.model "
                                                               "(repeat for several). Default: any."),
    options: dict = None,
) -> None:
    """Put every row of INPUT on the request stream as job NAME, for `batchgen worker`s to generate.

    Rows get the same checks as in `batchgen run`; a row that fails them gets its error result on the
    job's result stream at once. Submitting the same INPUT as the same job again adds nothing twice:
    an interrupted submit continues where it stopped, a finished one does nothing.
    """
    import redis

    from batchgen.io import InputError
    from batchgen.queue import SubmitError, redact, submit_job

    _check_input(input)
    _check_input_format(input, input_format)
    served = _served_models(served_model_name, None) if served_model_name else None
    keys, client = _queue(options, job)
    try:
        result = submit_job(client, keys, job, input, input_format=input_format.value, served_models=served)
    except (InputError, SubmitError) as e:
        raise _fail(str(e)) from None
    except redis.RedisError as e:
        raise _redis_failure(e, options, "rerun submit: it continues where it stopped") from None
    except Exception as e:
        raise _unexpected(e) from None
    where = f"{keys.requests} at {redact(options['redis_url'])}"
    if result.rows == 0:
        print(f"job {job}: {input} has no rows; nothing to add")
        return
    if result.queued == 0 and result.errors == 0:
        print(f"job {job}: all {result.rows} rows were submitted before; nothing to add")
        return
    earlier = f"; {result.earlier} rows were submitted before" if result.earlier else ""
    print(f"job {job}: {result.queued} requests added to {where}, {result.errors} rows failed the checks "
          f"(their error results are in {keys.results(job)}){earlier}; {result.rows} rows in all")


@app.command()
@_with_options(QUEUE_OPTIONS, ENGINE_OPTIONS, SAMPLING_OPTIONS)
def worker(
    consumer: Optional[str] = typer.Option(None, "--consumer", envvar=_env("CONSUMER"), rich_help_panel=QUEUE,
                                           help="This worker's name in the consumer group. Default: HOST-PID."),
    claim_idle_seconds: float = typer.Option(60.0, "--claim-idle-seconds", envvar=_env("CLAIM_IDLE_SECONDS"),
                                             rich_help_panel=QUEUE,
                                             help="Take over a request that another worker has held this long "
                                                  "without a sign of life (that worker died)."),
    max_deliveries: int = typer.Option(3, "--max-deliveries", envvar=_env("MAX_DELIVERIES"), rich_help_panel=QUEUE,
                                       help="A request delivered this many times without a result goes to the "
                                            "dead-letter stream, with an error result."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", envvar=_env("DRAIN_TIMEOUT"), rich_help_panel=QUEUE,
                                        help="On SIGTERM, finish in-flight requests for at most this many seconds; "
                                             "the rest go back to the stream."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", envvar=_env("METRICS_PORT"),
                                               rich_help_panel=QUEUE,
                                               help="Serve Prometheus metrics on this port "
                                                    "(0: any free port, logged)."),
    log_format: LogFormat = typer.Option(LogFormat.text, "--log-format", envvar=_env("LOG_FORMAT"),
                                         rich_help_panel=QUEUE, help="json: one JSON object a line."),
    options: dict = None,
) -> None:
    """Generate requests from the request stream until SIGTERM: any number of workers, on any hosts,
    share one Redis.

    Requests flow into the running engine as it has room; each result goes to its job's result
    stream, then the request is acknowledged. The requests of a worker that dies are taken over by
    the others after --claim-idle-seconds. SIGTERM/SIGINT: read no more, finish what is in flight
    (up to --drain-timeout), hand the rest back, exit 0; a second signal stops at once.
    """
    import socket

    import redis

    from batchgen.logs import setup_logging
    from batchgen.queue import Worker, WorkerConfig, redact
    from batchgen.queue.metrics import WorkerMetrics

    setup = _engine_setup(options)
    keys, client = _queue(options)
    name = consumer or f"{socket.gethostname()}-{os.getpid()}"
    try:
        config = WorkerConfig(consumer=name, claim_idle_s=claim_idle_seconds, max_deliveries=max_deliveries,
                              drain_timeout_s=drain_timeout,
                              max_in_flight=2 * setup.engine_options["max_num_seqs"])
    except ValueError as e:
        raise _UsageError(str(e)) from None
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise typer.BadParameter("a port number, 0 to 65535", param_hint="'--metrics-port'")
    setup_logging(log_format.value)
    log = logging.getLogger("batchgen.worker")

    running: list = []  # the Worker, once the engine is up

    def on_signal(signum, frame) -> None:
        if not running:
            raise KeyboardInterrupt  # still loading: nothing taken yet, nothing to finish
        worker_, sig = running[0], signal.Signals(signum).name
        if worker_.draining.is_set():
            log.warning("%s again: stopping now; unfinished requests go back to the stream", sig)
        else:
            log.info("%s: draining: no more reading; finishing %d in-flight requests (at most %gs)", sig,
                     len(worker_.in_flight), drain_timeout,
                     extra={"event": "draining", "in_flight": len(worker_.in_flight),
                            "results": worker_.counts["results"]})
        worker_.drain()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    metrics = None
    try:
        log.info("worker %s: loading the engine; queue %s at %s", name, keys.requests, redact(options["redis_url"]))
        llm = setup.make_llm()
        metrics = WorkerMetrics(llm)
        if metrics_port is not None:
            port = metrics.serve(metrics_port)
            log.info("metrics on http://0.0.0.0:%d/metrics", port, extra={"event": "metrics", "port": port})
        description = {**llm.describe(), **setup.described, "settings": setup.settings, "host": socket.gethostname()}
        running.append(Worker(client, keys, llm, setup.sampling, config, metrics, description))
        log.info("worker %s: serving %s (group workers, claim idle %gs, max deliveries %d)", name, keys.requests,
                 claim_idle_seconds, max_deliveries, extra={"event": "serving", "consumer": name})
        running[0].run()
    except KeyboardInterrupt:
        log.info("stopped before taking any request")
    except _BadSetting as e:
        raise _fail(str(e), EXIT_USAGE) from None
    except redis.RedisError as e:
        raise _redis_failure(e, options, "stopping") from None
    except Exception as e:
        raise _unexpected(e) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if metrics is not None:
            metrics.close()


@app.command(no_args_is_help=True)
@_with_options(QUEUE_OPTIONS)
def collect(
    output: Path = typer.Argument(..., help="Results: a Parquet file (or, named *.jsonl, an OpenAI batch output "
                                            "file), written when every row has a result.", show_default=False),
    job: str = typer.Option(..., "--job", **JOB_NAME),
    timeout: Optional[float] = typer.Option(None, "--timeout", envvar=_env("TIMEOUT"), rich_help_panel=QUEUE,
                                            min=0.0, show_default=False,
                                            help=f"Give up after this many seconds (exit {EXIT_TIMEOUT}). "
                                                 "Default: wait as long as it takes."),
    delete: bool = typer.Option(False, "--delete", envvar=_env("DELETE"), rich_help_panel=QUEUE,
                                help="Once OUTPUT is written, delete the job's keys from Redis."),
    output_format: OutputFormat = typer.Option(OutputFormat.auto, "--output-format", envvar=_env("OUTPUT_FORMAT"),
                                               rich_help_panel=OPENAI,
                                               help="openai: the OpenAI batch output file (JSONL); "
                                                    "auto: openai for an OUTPUT named *.jsonl, else parquet."),
    error_file: Optional[Path] = typer.Option(None, "--error-file", envvar=_env("ERROR_FILE"), rich_help_panel=OPENAI,
                                              help="OpenAI output: write failed lines here instead of into OUTPUT."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", envvar=_env("TOKENIZER"), rich_help_panel=OPENAI,
                                            metavar="MODEL",
                                            help="OpenAI output: the model (as --model; 'default': the embedded "
                                                 "one) whose tokenizer spells the tokens of logprobs. Default: "
                                                 "the engine's text where it gave one, else token_id:ID."),
    options: dict = None,
) -> None:
    """Wait until every row of job NAME has a result, then write them to OUTPUT: the same Parquet file
    as `batchgen run` writes, one row per submitted row."""
    import redis

    from batchgen.io import JobError
    from batchgen.queue import CollectTimeout, collect_job

    keys, client = _queue(options, job)
    if output.is_dir():
        raise typer.BadParameter(f"{str(output)!r} is a directory; give a file name such as out.parquet",
                                 param_hint="'OUTPUT'")
    formats = _formats(None, output, InputFormat.auto, output_format, error_file)
    token_text = _token_text(tokenizer) if tokenizer is not None else None
    stop_event = threading.Event()
    try:
        with _Signals(stop_event):
            result = collect_job(client, keys, job, output, timeout, should_stop=stop_event.is_set, delete=delete,
                                 output_format=formats["output_format"], error_file=formats["error_file"],
                                 token_text=token_text)
    except CollectTimeout as e:
        raise _fail(str(e), EXIT_TIMEOUT) from None
    except JobError as e:
        raise _fail(str(e)) from None
    except redis.RedisError as e:
        raise _redis_failure(e, options, "rerun collect") from None
    except KeyboardInterrupt:
        print("batchgen: interrupted; nothing written (the results stay in Redis: rerun collect)", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        raise _unexpected(e) from None
    meta = result.metadata
    extra = f", {result.extra} extra (messages no submitted row made)" if result.extra else ""
    print(f"done: {meta['rows']} rows ({meta['rows_ok']} ok, {meta['rows_error']} errors{extra}) -> {output}")
    speed = f", {meta['output_tokens_per_s']:,.1f} output tok/s" if meta.get("output_tokens_per_s") else ""
    print(f"tokens: {meta['prompt_tokens']:,} prompt, {meta['output_tokens']:,} output; job took "
          f"{meta['job_seconds']:.1f}s from submit to last result{speed}; workers: {len(meta['workers'])}; "
          f"{result.duplicates} duplicate results dropped")
    if result.unreadable:
        print(f"batchgen: {result.unreadable} result entries were not JSON and were skipped", file=sys.stderr)


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
    sampling = ", ".join(f"{k} {v}" for k, v in default_model.SAMPLING_DEFAULTS.items())
    print(f"sampling:      {sampling} (its model card's; in the cache's generation_config.json)")
    print("other models:  --model PATH (a local Hugging Face model directory)")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def bench(ctx: typer.Context) -> None:
    """Throughput benchmark on a GPU: benchmarks/throughput.py's workloads, batchgen against HF generate() in the
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
