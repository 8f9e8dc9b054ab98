"""Data parallelism: N engine replicas, each in a child process with its own GPU (or its own tensor-
parallel group of GPUs), fed from one reader and collected into one stream of results.

Rows go to replicas as each has room (a replica holds at most as many rows as one engine looks ahead
at), each to the replica with the least work outstanding (its rows' prompt and output tokens, as far as
they are known before tokenizing), so that the replicas finish together and a faster one takes more.
Rows that look alike at the start (a shared system prompt, a shared prefix) go to the replica that had
that prefix before, where it has room, so its prefix cache still pays. A row's n samples stay together.

A replica that dies (a CUDA error, out of memory, SIGKILL) loses no rows: the samples it had not
returned go to the others. A row that was on two replicas that died becomes an error row. When every
replica is gone, generate() raises ReplicaError naming the last one and why; the results already given
stand, and a rerun of the job completes it. Replicas end with their parent (executor/processes.py).

Messages, parent -> replica: ("job", defaults, threaded), ("rows", [row, ...]), ("end",) (no more rows
in this job), ("stop",) (stop now, as on SIGTERM), ("close",). Replica -> parent: ("row", result) and
("done", stats) at the end of each job.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from multiprocessing.connection import wait

import torch
from transformers import AutoTokenizer

from batchgen.config import EngineConfig
from batchgen.engine.finish import error_row
from batchgen.executor.cpu_threads import usable_cores
from batchgen.executor.memory import resolve_device
from batchgen.executor.processes import (
    EXIT_FAILED,
    EXIT_PARENT_GONE,
    EXIT_STOPPED,
    ChildGroup,
    exit_now,
    report_failure,
    watch_parent,
)
from batchgen.models.model_config import load_model_config
from batchgen.models.resolve import resolve_model_dir
from batchgen.sampling_params import SamplingParams, samples_of
from batchgen.schema import SAMPLES_KEY

_END = object()
REPLICA_KEY = "__batchgen_replica_row__"  # the parent's number of a row dealt, carried through its results
SEND_BATCH = 64  # rows a message: few messages, and a replica starts on a batch at once
PREFIX_CHARS = 256  # the start of a prompt that decides which replica gets it
AFFINITY_ENTRIES = 100_000  # prefixes remembered (least recently used go first)
AFFINITY_SLACK = 0.25  # a row follows its prefix to a replica with at most this much more work than the least


class ReplicaError(RuntimeError):
    """Every data-parallel replica failed; the message says which failed last and why."""


def data_parallel_size(config: EngineConfig) -> int:
    """config.data_parallel_size as a number: "auto" is every visible GPU over the tensor-parallel size
    (1 without a GPU)."""
    size = config.data_parallel_size
    if size != "auto":
        return int(size)
    if resolve_device(config.device).type != "cuda":
        return 1
    return max(1, torch.cuda.device_count() // config.tensor_parallel_size)


def replica_environments(config: EngineConfig, size: int) -> list[dict]:
    """Each replica's CUDA_VISIBLE_DEVICES: its own tensor_parallel_size GPUs of those visible."""
    if resolve_device(config.device).type != "cuda":
        return [{} for _ in range(size)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g.strip() for g in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    tp = config.tensor_parallel_size
    if size * tp > len(gpus):
        raise ValueError(f"invalid --data-parallel-size: {size} replicas x {tp} GPUs each need {size * tp} GPUs, "
                         f"{len(gpus)} visible")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp : (i + 1) * tp])} for i in range(size)]


def prefix_key(row) -> bytes | None:
    """What a row's prompt starts with, as a short digest: rows with the same key likely share a prefix."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str):
        start = row["prompt"][:PREFIX_CHARS]
    elif isinstance(row.get("messages"), list) and row["messages"]:
        messages = row["messages"]
        start = json.dumps(messages[:-1] if len(messages) > 1 else messages, default=str)[:PREFIX_CHARS]
    elif isinstance(row.get("prompt_token_ids"), list):
        start = repr(row["prompt_token_ids"][:64])
    else:
        return None
    return hashlib.blake2b(start.encode(errors="replace"), digest_size=8).digest()


def estimated_tokens(row: dict, default_max_tokens: int, samples: int) -> int:
    """A row's tokens before it is tokenized: its prompt (token ids, or ~4 characters a token) and
    max_tokens for each sample."""
    if isinstance(row.get("prompt_token_ids"), list):
        prompt = len(row["prompt_token_ids"])
    elif isinstance(row.get("prompt"), str):
        prompt = len(row["prompt"]) // 4
    else:
        prompt = len(json.dumps(row.get("messages"), default=str)) // 4
    max_tokens = row.get("max_tokens")
    max_tokens = max_tokens if isinstance(max_tokens, int) and 0 < max_tokens < 2**31 else default_max_tokens
    return prompt + max_tokens * max(samples, 1)


@dataclasses.dataclass
class _Dealt:
    """A row on a replica: the sample indices it should give and those it gave."""

    row: dict
    expected: set[int]
    work: int = 0  # its tokens, estimated: prompt + max_tokens for each sample
    given: set[int] = dataclasses.field(default_factory=set)
    deaths: int = 0  # replicas that died holding it


@dataclasses.dataclass
class _Replica:
    index: int
    conn: object
    state: str = "idle"  # idle -> running -> ending ("end" sent) -> idle ("done" back); dead
    rows: dict = dataclasses.field(default_factory=dict)  # dealt number -> _Dealt
    work: int = 0  # the estimated tokens of its rows
    outbox: list = dataclasses.field(default_factory=list)
    stats: dict = dataclasses.field(default_factory=dict)
    results: int = 0
    last_result: float | None = None  # time.monotonic() of its last result in this job
    generated_tokens: int = 0  # its engine's count as of its last result


class ReplicaPool:
    """N replicas of the engine behind the interface LLM uses: generate(), describe(), close()."""

    def __init__(self, config: EngineConfig):
        size = data_parallel_size(config)
        self.config = config
        self.model_dir = resolve_model_dir(config.model)  # (the default model is converted once, here)
        self.model_cfg = load_model_config(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=config.trust_remote_code)
        environments = replica_environments(config, size)
        replica_config = dataclasses.replace(config, model=str(self.model_dir), data_parallel_size=1)
        if resolve_device(config.device).type == "cpu" and config.cpu_threads is None:  # the cores, shared evenly
            replica_config.cpu_threads = max(1, usable_cores() // (size * config.tensor_parallel_size))
        self.stats: dict = {}
        self.children = ChildGroup(
            replica_main, [(replica_config, size) for _ in range(size)],
            [f"batchgen-dp-replica{i}" for i in range(size)], duplex=True, daemon=False,
            environments=environments,
        )
        self.replicas = [_Replica(i, conn) for i, conn in enumerate(self.children.work)]
        self._closed = False
        try:
            self.described = self.children.wait_ready(lambda: None)
            if self.children.failures:
                index, reason = next(iter(self.children.failures.items()))
                raise ReplicaError(f"data-parallel replica {index} failed to start: {reason}")
        except BaseException:
            self.close()
            raise
        # rows a replica holds: what one engine runs and looks ahead at (engine.generate's lookahead)
        self.room = 5 * config.max_num_seqs
        self._affinity: OrderedDict[bytes, int] = OrderedDict()

    @property
    def generated_tokens(self) -> int:
        """Tokens the replicas sampled so far, as of each one's last result (progress displays read it)."""
        return sum(r.generated_tokens for r in self.replicas)

    def describe(self) -> dict:
        first = self.described[min(self.described)]
        return {**first, "data_parallel_size": len(self.replicas)}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the replicas, which frees their GPUs (also done when the pool is dropped, and at interpreter
        exit: they watch this process)."""
        if self._closed:
            return
        self._closed = True
        self.children.close(lambda conn: conn.send(("close",)))

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    # ---- a job ---------------------------------------------------------------------------------
    def generate(self, requests: Iterable[dict], defaults: SamplingParams,
                 stop_event: threading.Event | None = None, threaded: bool = True) -> Iterator[dict]:
        """LLMEngine.generate over the replicas: one result row per request, as each finishes."""
        source = iter(requests)
        exhausted = stopping = False
        index = number = 0
        redo: list[tuple[int, _Dealt]] = []  # rows of replicas that died, to deal again
        first_row = last_result = None
        for replica in self.replicas:
            replica.stats, replica.results, replica.last_result = {}, 0, None
        try:
            while True:
                yield from self._bury_the_dead(redo)
                if stop_event is not None and stop_event.is_set() and not stopping:
                    stopping = True
                    for replica in self._alive("running", "ending"):
                        self._flush(replica)
                        replica.conn.send(("stop",))
                        replica.state = "ending"
                # deal rows of replicas that died first, then new rows, while a replica has room
                while not stopping and (redo or not exhausted) and self._with_room():
                    if redo:
                        dealt_number, dealt = redo.pop()
                        self._deal(dealt_number, dealt, defaults, threaded)
                        continue
                    row = next(source, _END)
                    if row is _END:
                        exhausted = True
                        break
                    if row is None:  # a live source with nothing right now
                        break
                    if isinstance(row, dict) and row.get("id") is None:
                        row = {**row, "id": index}
                    index += 1
                    if not isinstance(row, dict):
                        yield error_row(row, f"a request must be an object, got {type(row).__name__}")
                        continue
                    first_row = first_row or time.monotonic()
                    self._deal(number, self._dealt(row, defaults), defaults, threaded)
                    number += 1
                for replica in self._alive("running"):
                    self._flush(replica)
                    if exhausted and not redo:
                        replica.conn.send(("end",))  # it finishes what it has, then says done
                        replica.state = "ending"
                if not self._alive("running", "ending") and (stopping or (exhausted and not redo)):
                    break
                if not self._alive():
                    raise ReplicaError(self._last_failure())
                for result in self._receive(timeout=0.05 if exhausted else 0.005):
                    last_result = time.monotonic()
                    yield result
        finally:
            self._settle()
            output = sum(r.stats.get("output_tokens", 0) for r in self.replicas)
            prompt = sum(r.stats.get("prompt_tokens", 0) for r in self.replicas)
            seconds = (last_result - first_row) if first_row and last_result else 0.0
            self.stats = {
                "generation_seconds": seconds, "prompt_tokens": prompt, "output_tokens": output,
                "replicas": [{"replica": r.index, "rows": r.results, "output_tokens": r.stats.get("output_tokens", 0),
                              "generation_seconds": r.stats.get("generation_seconds", 0.0),
                              # from the job's first row to this replica's last result: when it went idle
                              "idle_after_s": (r.last_result - first_row) if r.last_result and first_row else None,
                              "failed": r.state == "dead"} for r in self.replicas],
            }

    def _dealt(self, row: dict, defaults: SamplingParams) -> _Dealt:
        wanted = row.get(SAMPLES_KEY)
        expected = set(wanted) if isinstance(wanted, list) else set(range(samples_of(row, defaults.n)))
        return _Dealt(row, expected, estimated_tokens(row, defaults.max_tokens, len(expected)))

    def _with_room(self) -> list[_Replica]:
        """Replicas that can take a row now: running, or idle (a job starts on them when dealt to)."""
        return [r for r in self._alive("running", "idle") if len(r.rows) < self.room]

    def _deal(self, number: int, dealt: _Dealt, defaults: SamplingParams, threaded: bool) -> None:
        """Give a row to the replica that had its prefix last, where it has room and is not the busiest by
        far, else to the one with the least work outstanding."""
        candidates = self._with_room()
        key = prefix_key(dealt.row)
        least = min(candidates, key=lambda r: r.work)
        preferred = self.replicas[self._affinity[key]] if key in self._affinity else None
        near = preferred in candidates and preferred.work <= least.work + AFFINITY_SLACK * (1 + least.work)
        chosen = preferred if near else least
        if key is not None:
            self._affinity[key] = chosen.index
            self._affinity.move_to_end(key)
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        if chosen.state == "idle":
            chosen.conn.send(("job", defaults, threaded))
            chosen.state = "running"
        row = {**dealt.row, REPLICA_KEY: number}
        if dealt.given or dealt.deaths:  # dealt again: only the samples not given yet
            row[SAMPLES_KEY] = sorted(dealt.expected - dealt.given)
        chosen.rows[number] = dealt
        chosen.work += dealt.work
        chosen.outbox.append(row)
        if len(chosen.outbox) >= SEND_BATCH:
            self._flush(chosen)

    def _flush(self, replica: _Replica) -> None:
        if replica.outbox:
            replica.conn.send(("rows", replica.outbox))
            replica.outbox = []

    def _alive(self, *states: str) -> list[_Replica]:
        return [r for r in self.replicas if r.state != "dead" and (not states or r.state in states)]

    def _receive(self, timeout: float) -> list[dict]:
        """The results the replicas sent, waiting up to timeout for the first."""
        conns = {r.conn: r for r in self._alive("running", "ending")}
        if not conns:
            time.sleep(timeout)
            return []
        results = []
        for conn in wait(list(conns), timeout):
            replica = conns[conn]
            try:
                while conn.poll():
                    kind, payload = conn.recv()
                    if kind == "row":
                        result, replica.generated_tokens = payload
                        results.append(self._given(replica, result))
                    elif kind == "done":
                        replica.stats, replica.state = payload, "idle"
                        replica.rows.clear()
                        replica.work = 0
            except (EOFError, OSError):
                pass  # (it died: the monitor reports why)
        return results

    def _given(self, replica: _Replica, result: dict) -> dict:
        number = result.pop(REPLICA_KEY, None)
        replica.results += 1
        replica.last_result = time.monotonic()
        dealt = replica.rows.get(number)
        if dealt is not None:
            dealt.given.add(result.get("sample_index") or 0)
            # an error row answers the whole request (a refused one gives no other row)
            if result.get("finish_reason") == "error" or dealt.given >= dealt.expected:
                del replica.rows[number]
                replica.work -= dealt.work
        return result

    def _bury_the_dead(self, redo: list) -> list[dict]:
        """Replicas that died since the last look: their rows not answered go to the others; -> the
        results they sent before they died, and error rows of those that were on a replica that died
        before."""
        poisoned = []
        for index, reason in list(self.children.failures.items()):
            replica = self.replicas[index]
            if replica.state == "dead":
                continue
            replica.state = "dead"
            poisoned += self._receive_last(replica)
            for number, dealt in replica.rows.items():
                dealt.deaths += 1
                if dealt.deaths >= 2:
                    poisoned.append(error_row(dealt.row, "two data-parallel replicas died while running this row; "
                                                         f"the last: {reason}"))
                else:
                    redo.append((number, dealt))
            replica.rows.clear()
            replica.work = 0
            replica.outbox = []
        return poisoned

    def _receive_last(self, replica: _Replica) -> list[dict]:
        """The results a dead replica sent before it died (in its pipe still): they count."""
        results = []
        try:
            while replica.conn.poll():
                kind, payload = replica.conn.recv()
                if kind == "row":
                    results.append(self._given(replica, payload[0]))
        except (EOFError, OSError):
            pass
        return results

    def _last_failure(self) -> str:
        index, reason = list(self.children.failures.items())[-1]
        return f"data-parallel replica {index} failed: {reason} (every replica has failed; rerun to finish the job)"

    def _settle(self) -> None:
        """After a job, or a consumer that quit early: every live replica stopped and idle."""
        for replica in self._alive("running", "ending"):
            try:
                replica.conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 120
        while self._alive("running", "ending") and time.monotonic() < deadline:
            self._bury_the_dead([])
            self._receive(timeout=0.05)


# ---- a replica process -----------------------------------------------------------------------------
def replica_main(index: int, config: EngineConfig, size: int, work, life) -> None:
    watch_parent(life)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent stops the job; a replica ends with it
        signal.signal(sig, signal.SIG_IGN)
    engine = None
    try:
        from batchgen.engine.engine import LLMEngine

        engine = LLMEngine(config)
        life.send(("ready", engine.describe()))
        inbox: queue.Queue = queue.Queue()
        stop = threading.Event()
        threading.Thread(target=_read_messages, args=(work, inbox, stop), daemon=True).start()
        while True:
            message = inbox.get()
            if message[0] == "close":
                break
            if message[0] != "job":  # (the end or stop of a job that is over)
                continue
            _, defaults, threaded = message
            for result in engine.generate(_rows(inbox, engine), defaults, stop, threaded):
                work.send(("row", (result, engine.generated_tokens)))
            work.send(("done", engine.stats))
    except BaseException as e:
        report_failure(life, f"data-parallel replica {index}", e)
        exit_now(EXIT_FAILED)
    engine.close()
    exit_now(EXIT_STOPPED)


def _read_messages(work, inbox: queue.Queue, stop: threading.Event) -> None:
    """The parent's messages into inbox, in order; "job" clears the stop flag, "stop" raises it."""
    try:
        while True:
            message = work.recv()
            if message[0] == "job":
                stop.clear()
            elif message[0] == "stop":
                stop.set()
            inbox.put(message)
    except (EOFError, OSError):
        exit_now(EXIT_PARENT_GONE)


def _rows(inbox: queue.Queue, engine) -> Iterator[dict | None]:
    """A job's rows as the parent sends them: None while none has come (waiting a moment when the
    engine is idle, so that it does not spin), and the end at "end" or "stop"."""
    while True:
        try:
            message = inbox.get_nowait() if engine.has_work() else inbox.get(timeout=0.01)
        except queue.Empty:
            yield None
            continue
        if message[0] == "rows":
            yield from message[1]
        elif message[0] in ("end", "stop"):
            return
