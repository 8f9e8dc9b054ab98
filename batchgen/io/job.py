"""A file job: input file -> checks -> engine -> part files -> OUTPUT, resumable and interruptible.

The engine pulls requests lazily from `requests()` in `run_job`, so the input streams through in
bounded memory: rows are read, checked and handed over only as the engine has room. Rows that fail
the checks, rows of other shards and rows that an earlier run finished never reach the engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io import openai_output
from batchgen.io.layout import Layout
from batchgen.io.openai_input import CHAT_URL, COMPLETIONS_URL, make_checker, resolve_input_format
from batchgen.io.parts import OutputWriteError, PartWriter, list_parts
from batchgen.io.resume import JobError, WorkDir, describe_difference, input_identity, output_fingerprint, same_job
from batchgen.io.rows import ROW_KEY, ROW_SAMPLES_KEY
from batchgen.io.shard import Shard
from batchgen.io.sinks import Totals, merge_parts, prefix_cache_totals
from batchgen.io.sources import InputError, open_source
from batchgen.sampling_params import samples_of
from batchgen.schema import SAMPLES_KEY
from batchgen.token_text import TokenText, token_text_of


class Progress(Protocol):
    def start(self, total: int, resumed: int, tokens: Callable[[], int] | None = None) -> None:
        """`tokens()`: the tokens generated so far, rows unfinished included (None: count finished rows')."""
    def advance(self, row: dict) -> None: ...
    def stop(self) -> None: ...


class NoProgress:
    def start(self, total: int, resumed: int, tokens: Callable[[], int] | None = None) -> None:
        pass

    def advance(self, row: dict) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass
class JobSpec:
    input: Path
    output: Path
    settings: dict  # what shapes the output (model, dtype, sampling defaults, seed, ...): resume's fingerprint
    shard: Shard = field(default_factory=Shard)
    resume: bool = True
    overwrite: bool = False  # replace an OUTPUT that is not this job's finished output
    flush_rows: int = 1000
    flush_seconds: float = 5.0
    described: dict = field(default_factory=dict)  # more keys for the output's metadata (not fingerprinted)
    input_format: str = "auto"  # "auto" | "openai" | "batchgen"
    output_format: str = "parquet"  # "parquet" | "openai"
    served_models: list[str] | None = None  # OpenAI input: the body.model names accepted (first: recorded)
    error_file: Path | None = None  # OpenAI output: failed lines go here instead of OUTPUT

    @property
    def openai_output(self) -> bool:
        return self.output_format == "openai"


@dataclass
class JobResult:
    status: str  # "complete" | "already_complete" | "interrupted"
    rows_total: int = 0  # input rows of this shard
    rows_resumed: int = 0  # of them, done by an earlier run (every sample saved, or an error row)
    rows_this_run: int = 0  # of them, done by this run: rows_resumed of the next run is the sum
    totals: Totals | None = None  # over the final file; None unless complete
    metadata: dict[str, Any] = field(default_factory=dict)  # the final file's `batchgen` metadata


def fingerprint_of(spec: JobSpec, input_format: str) -> dict:
    formats = {}  # only where they are not the native ones: a native job's fingerprint stays as it was
    if input_format == "openai":
        formats.update(input_format=input_format)
    if spec.openai_output:
        formats.update(output_format=spec.output_format,
                       error_file=str(spec.error_file) if spec.error_file is not None else None)
    if formats:  # the model name that lines must give, and that responses carry
        formats.update(served_models=spec.served_models)
    return {
        **spec.settings,
        **formats,
        "shard": str(spec.shard),
        "input": input_identity(spec.input),
    }


def run_job(
    spec: JobSpec,
    make_llm: Callable[[], Any],
    sampling: Any,
    stop_event: threading.Event,
    progress: Progress | None = None,
    on_generation: Callable[[bool], None] = lambda active: None,
    started: float | None = None,
) -> JobResult:
    """Runs the job; JobError (and sources.InputError) for a job that cannot start.

    `on_generation(True)` is called when the engine starts pulling rows and `on_generation(False)`
    when it stops: the CLI's signal handler sets `stop_event` in between and interrupts otherwise.
    `started` (time.monotonic()) is when the command started, for `wall_seconds`.
    """
    try:
        return _run_job(spec, make_llm, sampling, stop_event, progress, on_generation, started)
    except OutputWriteError as e:  # a full disk, most likely
        raise JobError(f"{e}; the rows finished so far are kept: rerun the same command to resume") from None


def _run_job(spec, make_llm, sampling, stop_event, progress, on_generation, started) -> JobResult:
    started = time.monotonic() if started is None else started
    progress = progress or NoProgress()
    source = open_source(spec.input)
    try:
        input_format = resolve_input_format(spec.input, spec.input_format)
    except ValueError as e:
        raise InputError(str(e)) from None
    layout = Layout(source.schema)
    output = spec.output
    if output.is_dir():
        raise JobError(f"OUTPUT {str(output)!r} is a directory; give a file name such as out.parquet")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (a file where a folder should be, a read-only or virtual file system)
        raise JobError(f"cannot make OUTPUT's folder {str(output.parent)!r}: {e.strerror or e}") from None
    fingerprint = fingerprint_of(spec, input_format)
    finished_fingerprint = openai_output.stored_fingerprint if spec.openai_output else output_fingerprint
    stored_metadata = openai_output.stored_metadata if spec.openai_output else _stored_metadata
    workdir = WorkDir(output)
    finished_as = finished_fingerprint(output) if output.exists() else None
    if spec.resume and not workdir.path.exists() and same_job(finished_as, fingerprint):
        return JobResult("already_complete", metadata=stored_metadata(output))
    # A leftover of this job was begun by a run that passed this check (or had --overwrite).
    if (output.exists() and not spec.overwrite and not same_job(finished_as, fingerprint)
            and not same_job(workdir.stored_fingerprint(), fingerprint)):
        raise JobError(_not_this_job(spec, finished_as, fingerprint))

    workdir.open(fingerprint, spec.resume)
    finished_job = False
    try:
        if spec.resume and same_job(finished_fingerprint(output), fingerprint):
            # A run was stopped between renaming OUTPUT into place and removing its work directory.
            finished_job = True
            return JobResult("already_complete", metadata=stored_metadata(output))
        done = workdir.done_rows()
        rows_total = source.count_rows_where(lambda i: i in spec.shard)
        rows_resumed = done.num_rows
        llm = make_llm()
        progress.start(rows_total, rows_resumed, _token_counter(llm))
        sink = PartWriter(workdir.path, layout, spec.flush_rows, spec.flush_seconds)
        checker = make_checker(input_format, spec.served_models)
        # a native row going to an OpenAI output: chat rows answer as chat.completion, the rest as text_completion
        native_to_openai = spec.openai_output and input_format != "openai"

        samples_left: dict[int, int] = {}  # rows of several samples in the engine -> samples not finished
        samples_of_row: dict[int, int] = {}  # the same rows -> their n (saved with each sample for resume)
        rows_done = 0  # input rows done in this run: all their samples saved, or an error row

        def finished(row: dict) -> None:
            nonlocal rows_done
            index = row[ROW_KEY]
            row[ROW_SAMPLES_KEY] = samples_of_row.get(index)
            sink.add(row)
            if index in samples_left and row.get("finish_reason") != "error":
                samples_left[index] -= 1
                if samples_left[index]:
                    return
            samples_left.pop(index, None)
            samples_of_row.pop(index, None)
            rows_done += 1
            progress.advance(row)  # a row is done once all its samples are

        def requests():
            for row in _read(source, spec.input):
                request, error = checker.check(row)
                if row.index not in spec.shard:
                    continue
                if error is not None:
                    if not done.has_any(row.index):
                        finished(error)
                    continue
                samples = samples_of(request, getattr(sampling, "n", 1))  # (a bad n: the engine's error row)
                missing = done.missing(row.index, samples)
                if not missing:
                    continue
                if len(missing) < samples:  # an earlier run finished some of its samples
                    request[SAMPLES_KEY] = missing
                if len(missing) > 1:
                    samples_left[row.index] = len(missing)
                if samples > 1:
                    samples_of_row[row.index] = samples
                if native_to_openai:
                    request.setdefault("url", CHAT_URL if "messages" in request else COMPLETIONS_URL)
                yield request

        on_generation(True)
        try:
            for result in llm.generate(requests(), sampling=sampling, stop_event=stop_event):
                finished(_output_row(result))
        finally:
            on_generation(False)
            progress.stop()
            sink.flush()  # whatever happened, finished rows are kept
        rows_this_run = rows_done
        if stop_event.is_set():
            return JobResult("interrupted", rows_total, rows_resumed, rows_this_run)

        stats = dict(getattr(llm, "stats", None) or {})
        generation_seconds = stats.get("generation_seconds")
        generated_tokens = stats.get("output_tokens")

        def metadata(totals: Totals) -> dict:
            if totals.requests != rows_total:
                raise JobError(
                    f"{rows_total - totals.requests} rows of the input have no result (an engine bug?); "
                    f"rerun the same command to generate them"
                )
            meta = {**llm.describe(), **spec.described}
            meta.update(
                fingerprint=fingerprint,
                input=str(spec.input),
                shard=str(spec.shard),
                rows=totals.rows,
                input_rows=totals.requests,
                rows_ok=totals.rows_ok,
                rows_error=totals.rows_error,
                rows_resumed=rows_resumed,
                prompt_tokens=totals.prompt_tokens,
                output_tokens=totals.output_tokens,
                **prefix_cache_totals(totals),
                wall_seconds=round(time.monotonic() - started, 3),
                generation_seconds=generation_seconds,
                generated_output_tokens=generated_tokens,
                output_tokens_per_s=(
                    round(generated_tokens / generation_seconds, 2)
                    if generation_seconds and generated_tokens is not None
                    else None
                ),
                e2e_s=totals.percentiles("e2e_s"),
                ttft_s=totals.percentiles("ttft_s"),
            )
            if stats.get("replicas"):  # data parallel: each replica's share of this run
                meta["replicas"] = stats["replicas"]
            result.metadata = meta
            return meta

        result = JobResult("complete", rows_total, rows_resumed, rows_this_run)
        if spec.openai_output:
            result.totals = openai_output.write_openai_output(
                workdir.path, output, metadata, served_model=_served_model(spec),
                salt=json.dumps(fingerprint, sort_keys=True), token_text=_token_text(llm),
                error_file=spec.error_file, should_stop=stop_event.is_set,
            )
        else:
            result.totals = merge_parts(workdir.path, output, layout, metadata, should_stop=stop_event.is_set)
        finished_job = True
        return result
    finally:
        if finished_job or not list_parts(workdir.path):
            workdir.remove()  # done, or stopped before any row was saved: nothing to resume
        workdir.close()


def _read(source, path: Path):
    """The source's rows; a file that cannot be read on (a corrupt Parquet page, an I/O error) is an
    InputError that names it."""
    rows, read = iter(source), 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as e:
            after = f" after its first {read} rows" if read else ""
            raise InputError(f"input file {str(path)!r} cannot be read{after} (is it corrupt?): "
                             f"{type(e).__name__}: {' '.join(str(e).split())}") from None
        read += 1
        yield row


def _not_this_job(spec: JobSpec, finished_as: dict | None, fingerprint: dict) -> str:
    """Why an existing OUTPUT is not replaced without --overwrite."""
    if finished_as is None:
        what = "has no batchgen metadata" if not spec.openai_output else \
            f"has no matching {openai_output.sidecar_path(spec.output).name}"
        return (f"OUTPUT {str(spec.output)!r} exists and is not a finished batchgen output ({what}); "
                f"pass --overwrite to replace it, or give another OUTPUT")
    return (f"OUTPUT {str(spec.output)!r} is the finished output of a run with other settings "
            f"({describe_difference(finished_as, fingerprint)}); "
            f"pass --overwrite to replace it, or give another OUTPUT")


def _token_counter(llm) -> Callable[[], int] | None:
    """The engine's running count of generated tokens, where the LLM has one."""
    return (lambda: llm.generated_tokens) if hasattr(llm, "generated_tokens") else None


def _output_row(result: dict) -> dict:
    row = dict(result)
    assert ROW_KEY in row, "the engine dropped a carried-through key"
    if row.get("output_token_ids") is None:
        row["output_token_ids"] = []
    else:
        row["output_token_ids"] = [int(t) for t in row["output_token_ids"]]
    return row


def _served_model(spec: JobSpec) -> str:
    """The `model` of the responses of rows that record none (native input)."""
    return spec.served_models[0] if spec.served_models else str(spec.settings.get("model") or "batchgen")


def _token_text(llm) -> TokenText | None:
    tokenizer = getattr(llm, "tokenizer", None)
    return None if tokenizer is None else token_text_of(tokenizer)


def _stored_metadata(output: Path) -> dict:
    return json.loads((pq.read_schema(output).metadata or {})[b"batchgen"])
