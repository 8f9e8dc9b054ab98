"""ReplicaPool: the parent's side of data parallelism. It starts the replicas, deals rows to them
and gathers their results into one stream, re-dealing what a replica that died had not returned."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from multiprocessing.connection import wait

from transformers import AutoTokenizer

from batchgen.config import EngineConfig
from batchgen.engine.finish import error_row
from batchgen.executor.cpu_threads import usable_cores
from batchgen.executor.memory import resolve_device
from batchgen.models.model_config import load_model_config
from batchgen.models.resolve import resolve_model_dir
from batchgen.parallel.processes import ChildGroup
from batchgen.replicas.placement import data_parallel_size, estimated_tokens, prefix_key, replica_environments
from batchgen.replicas.replica_process import replica_main
from batchgen.sampling_params import SamplingParams, samples_of
from batchgen.schema import SAMPLES_KEY

_END = object()
REPLICA_KEY = "__batchgen_replica_row__"  # the parent's number of a row dealt, carried through its results
SEND_BATCH = 64  # rows a message: few messages, and a replica starts on a batch at once
AFFINITY_ENTRIES = 100_000  # prefixes remembered (least recently used go first)
AFFINITY_SLACK = 0.25  # a row follows its prefix to a replica with at most this much more work than the least


class ReplicaError(RuntimeError):
    """Every data-parallel replica failed; the message says which failed last and why."""


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
        self.room = 5 * self.describe()["max_num_seqs"]
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
