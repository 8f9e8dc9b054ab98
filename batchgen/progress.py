"""Progress of a file job: a rich bar on a terminal, plain periodic lines otherwise (cron and Airflow
logs), and the summary at the end."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from batchgen.sampling_params import BUILT_IN, MODEL, OPTION


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class _Counts:
    """Rows finished and tokens generated in this run; shared by both displays. `add` may be called
    from the engine's request-pulling code, hence the lock.

    Tokens come from the engine's running count (`live`, read as they are generated, so that long
    rows show their speed before they finish), else from the rows as they finish."""

    def __init__(self) -> None:
        self.total = self.resumed = self.rows = self.errors = self.finished_tokens = 0
        self.started = time.monotonic()
        self._live: Callable[[], int] | None = None
        self._live_at_start = 0
        self._lock = threading.Lock()

    def start(self, total: int, resumed: int, live: Callable[[], int] | None = None) -> None:
        self.total, self.resumed = total, resumed
        self._live, self._live_at_start = live, live() if live is not None else 0
        self.started = time.monotonic()

    def add(self, row: dict) -> None:
        with self._lock:
            self.rows += 1
            self.errors += row.get("finish_reason") == "error"
            self.finished_tokens += row.get("completion_tokens") or 0

    @property
    def tokens(self) -> int:
        """Tokens generated in this run."""
        return self._live() - self._live_at_start if self._live is not None else self.finished_tokens

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        left = self.total - self.resumed - self.rows
        if left <= 0:
            return 0.0
        return left * self.elapsed / self.rows if self.rows else None


class _SpeedColumn(ProgressColumn):
    """Output tokens/s and errors, read from the counts at each refresh (not only when a row ends)."""

    def __init__(self, counts: _Counts) -> None:
        super().__init__()
        self.counts = counts

    def render(self, task) -> Text:
        return Text(f"rows  {self.counts.tokens_per_s:,.0f} tok/s  {self.counts.errors} errors")


class RichBar:
    """rows done/total (resumed rows count as done), output tokens/s, errors, elapsed and ETA."""

    def __init__(self, console: Console) -> None:
        self.counts = _Counts()
        self._bar = Progress(
            TextColumn("[bold]generating"),
            BarColumn(),
            MofNCompleteColumn(),
            _SpeedColumn(self.counts),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task = None

    def start(self, total: int, resumed: int, tokens: Callable[[], int] | None = None) -> None:
        self.counts.start(total, resumed, tokens)
        self._task = self._bar.add_task("rows", total=total, completed=resumed)
        self._bar.start()

    def advance(self, row: dict) -> None:
        self.counts.add(row)
        self._bar.update(self._task, advance=1)

    def stop(self) -> None:
        self._bar.stop()


class LogLines:
    """A line every `interval` seconds, from a timer thread so that lines keep coming while long
    rows are in flight: `progress: 120/640 rows (3 errors), 107,100 tokens, 1,530 tok/s, elapsed 1m10s,
    ETA 2m10s`. Tokens count as they are generated (given the engine's count)."""

    def __init__(self, console: Console, interval: float = 10.0) -> None:
        self.console = console
        self.interval = interval
        self.counts = _Counts()
        self._stopped = threading.Event()
        self._timer: threading.Thread | None = None

    def start(self, total: int, resumed: int, tokens: Callable[[], int] | None = None) -> None:
        self.counts.start(total, resumed, tokens)
        resumed_text = f", {resumed} done by an earlier run" if resumed else ""
        self._line(f"starting: {total} rows{resumed_text}")
        if self.interval > 0:
            self._timer = threading.Thread(target=self._tick, name="batchgen-progress", daemon=True)
            self._timer.start()

    def _tick(self) -> None:
        while not self._stopped.wait(self.interval):
            self.report()

    def advance(self, row: dict) -> None:
        self.counts.add(row)

    def report(self) -> None:
        c = self.counts
        self._line(
            f"progress: {c.resumed + c.rows}/{c.total} rows ({c.errors} errors), {c.tokens:,} tokens, "
            f"{c.tokens_per_s:,.0f} tok/s, elapsed {_duration(c.elapsed)}, ETA {_duration(c.eta)}"
        )

    def stop(self) -> None:
        self._stopped.set()
        if self._timer is not None:
            self._timer.join()

    def _line(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.console.print(f"{stamp} batchgen {text}", markup=False, highlight=False, soft_wrap=True)


def make_progress(console: Console, interval: float = 10.0) -> RichBar | LogLines:
    return RichBar(console) if console.is_terminal else LogLines(console, interval)


def summary_lines(meta: dict, output: str) -> list[str]:
    """The end-of-job summary, from the output file's `batchgen` metadata."""

    def seconds(stats: dict | None) -> str:
        stats = stats or {}
        if stats.get("p50") is None:
            return "n/a"
        return f"p50 {stats['p50']:.2f}s, p95 {stats['p95']:.2f}s"

    resumed = f", {meta['rows_resumed']} of them from an earlier run" if meta.get("rows_resumed") else ""
    tok_s = meta.get("output_tokens_per_s")
    speed = f"{tok_s:,.1f} output tok/s" if tok_s is not None else "no tokens generated in this run"
    gen_s = meta.get("generation_seconds") or 0.0
    input_rows = meta.get("input_rows")  # fewer than rows where rows have n samples (a Parquet output)
    of_rows = f" of {input_rows} input rows" if input_rows is not None and input_rows != meta["rows"] else ""
    lines = [
        f"done: {meta['rows']} rows{of_rows} ({meta['rows_ok']} ok, {meta['rows_error']} errors{resumed}) -> {output}",
        f"tokens: {meta['prompt_tokens']:,} prompt, {meta['output_tokens']:,} output; {speed} "
        f"({gen_s:.1f}s generating, {meta.get('wall_seconds', 0.0):.1f}s wall)",
        f"latency: e2e {seconds(meta.get('e2e_s'))}; TTFT {seconds(meta.get('ttft_s'))}",
    ]
    for replica in meta.get("replicas") or []:
        seconds_generating = replica.get("generation_seconds") or 0.0
        rate = f", {replica['output_tokens'] / seconds_generating:,.1f} output tok/s" if seconds_generating else ""
        failed = " (failed during the run: its rows went to the others)" if replica.get("failed") else ""
        lines.append(f"replica {replica['replica']}: {replica['rows']} rows{rate}{failed}")
    if meta.get("sampling_defaults"):
        lines.append(sampling_defaults_line(meta["sampling_defaults"], meta.get("sampling_defaults_from") or {}))
    return lines


# where a job's sampling default came from (sampling_params.resolve_defaults' names) -> how the summary says it
_SOURCES = {OPTION: "from options", MODEL: "from the model's generation_config.json", BUILT_IN: "built in"}


def sampling_defaults_line(defaults: dict, sources: dict) -> str:
    """`sampling defaults: temperature 0.2, top_p 0.9 from the model's generation_config.json;
    max_tokens 256, top_k -1 built in (a row's own fields override them)`."""
    groups = []
    for source, words in _SOURCES.items():
        names = [n for n in defaults if sources.get(n, BUILT_IN) == source]
        if names:
            groups.append(", ".join(f"{n} {_value(defaults[n])}" for n in names) + f" {words}")
    return f"sampling defaults: {'; '.join(groups)} (a row's own fields override them)"


def _value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(repr(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)
