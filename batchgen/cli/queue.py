"""The Redis queue's commands: `submit` puts a job's rows on the request stream, `worker`s generate them,
`collect` writes a job's results to a file."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from batchgen.cli.engine_setup import _engine_setup
from batchgen.cli.errors import EXIT_INTERRUPTED, EXIT_USAGE, _BadSetting, _fail, _unexpected, _UsageError
from batchgen.cli.files import _check_input, _check_input_format, _formats, _served_models, _token_text
from batchgen.cli.options import (
    ENGINE_OPTIONS,
    OPENAI,
    QUEUE,
    QUEUE_OPTIONS,
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
from batchgen.interrupts import raise_if_dropped

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


@_with_options(QUEUE_OPTIONS)
def submit(
    input: Path = typer.Argument(..., help="Prompts: a .jsonl file (one JSON object a line) or a .parquet file.",
                                 show_default=False, parser=file_path, metavar="INPUT"),
    job: str = typer.Option(..., "--job", **JOB_NAME),
    input_format: InputFormat = input_format_option(
        "openai: INPUT is an OpenAI batch file; auto: told by its first line."),
    served_model_name: Optional[list[str]] = served_model_name_option(
        "The model names OpenAI lines may give in body.model (repeat for several). Default: any."),
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
                              drain_timeout_s=drain_timeout)
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
        raise_if_dropped()
        log.info("worker %s: loading the engine; queue %s at %s", name, keys.requests, redact(options["redis_url"]))
        llm = setup.make_llm()
        config.max_in_flight = 2 * llm.describe()["max_num_seqs"]  # (the engine's, resolved on its device)
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


@_with_options(QUEUE_OPTIONS)
def collect(
    output: Path = typer.Argument(..., help="Results: a Parquet file (or, named *.jsonl, an OpenAI batch output "
                                            "file), written when every row has a result.", show_default=False,
                                  parser=file_path, metavar="OUTPUT"),
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
                                              parser=file_path,
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
