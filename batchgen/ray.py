"""A Ray Data stage (the `batchgen[ray]` extra): `Generate`, a callable class for `Dataset.map_batches`.

    ds.map_batches(Generate, fn_constructor_kwargs={"model": ..., "sampling": {...}, **engine_options},
                   batch_size=256, compute=ActorPoolStrategy(size=4, max_tasks_in_flight_per_actor=4),
                   max_concurrency=2, num_gpus=TP)

Each actor builds one engine (`LLM`) in __init__. The input rows are `batchgen run`'s; each batch comes
back in the format it came in (Ray's default dict of numpy arrays, pandas, pyarrow) with one row per
result (a row with n samples gives n rows): its input columns, then `run`'s output columns. A bad row
becomes an error row; the stage never raises for one.

Pipelining. `__call__` is a coroutine, so Ray Data runs it on the actor's event loop and lets several
batches be in it at once (up to 4 of one task's batches, and `max_concurrency` tasks). The engine runs
on one thread for the actor's life, pulling requests from a queue (`_EngineThread`): a batch puts its
rows there and awaits its results, so the rows of the next batch join the engine's running batch while
the current batch's last rows finish, and the device need not drain between Ray batches.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from batchgen.config import EngineConfig
from batchgen.io.rows import RESERVED, ROW_KEY, RowError, check_id, checked_request, error_row
from batchgen.io.sinks import OPTIONAL_OUTPUT_TYPES, OUTPUT_TYPES
from batchgen.llm import LLM
from batchgen.sampling_params import SamplingParams, samples_of
from batchgen.schema import KNOWN_FIELDS

log = logging.getLogger("batchgen")

# `run`'s sampling options that are engine settings (the job seed, where the defaults come from)
SAMPLING_ENGINE_OPTIONS = ("seed", "generation_config")
SAMPLING_OPTIONS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "seed")


class Generate:
    """batchgen's engine as a map_batches stage. `model`: a local HF directory (None: the embedded
    default model); `sampling`: `batchgen run`'s sampling options by name (max_tokens, temperature,
    top_p, top_k, min_tokens, stop, stop_token_ids, ignore_eos, n, seed, response_format,
    structured_outputs, generation_config); the rest: `LLM`'s engine options (EngineConfig's fields).
    A sampling option not given comes from the model's generation_config.json, else batchgen's
    built-in, as with `run`. ValueError for a bad option."""

    def __init__(self, model: str | None = None, sampling: dict | None = None, **engine_options):
        given, engine_options = self.check_options(model, sampling, **engine_options)
        self.llm = LLM(model=model, **engine_options)
        # run's resolution: an option given, else the model's generation_config.json, else built-in
        self.sampling = self.llm.get_default_sampling_params(**given)
        self._engine = _EngineThread(self.llm, self.sampling)
        self._ids = _IdMaker()

    @staticmethod
    def check_options(model: str | None = None, sampling: dict | None = None,
                      **engine_options) -> tuple[dict, dict]:
        """The options' names and the engine options' values, checked without loading the model
        (ValueError names the bad one) -> (sampling options given, engine options with the job seed
        and generation_config that `sampling` may hold)."""
        given = {name: value for name, value in (sampling or {}).items() if value is not None}
        unknown = sorted(set(given) - set(SAMPLING_OPTIONS) - set(SAMPLING_ENGINE_OPTIONS))
        if unknown:
            known = ", ".join(sorted((*SAMPLING_OPTIONS, *SAMPLING_ENGINE_OPTIONS)))
            raise ValueError(f"unknown sampling option {', '.join(unknown)}; known: {known}")
        engine_options = dict(engine_options)
        for name in SAMPLING_ENGINE_OPTIONS:
            if name not in given:
                continue
            value = given.pop(name)
            if engine_options.get(name, value) != value:
                raise ValueError(f"{name} given twice, {value!r} in sampling and {engine_options[name]!r} "
                                 f"as an engine option: give it once")
            engine_options[name] = value
        config_options = {k: v for k, v in engine_options.items() if k != "tokenizer_pool"}  # (LLM's own)
        try:
            EngineConfig(model=model, **config_options)
        except TypeError as e:  # an unknown engine option
            raise ValueError(f"{e}; the engine options are EngineConfig's fields") from None
        return given, engine_options

    async def __call__(self, batch: pa.Table | pd.DataFrame | dict) -> pa.Table | pd.DataFrame | dict:
        frame = _Frame.of(batch)
        keys = self._ids.keys(frame.num_rows)  # ROW_KEY of each input row: unique in this actor
        requests, answered = [], {}
        for key, data in zip(keys, frame.request_fields()):
            request, error = self._check(key, data, frame)
            if error is not None:
                answered[key] = [error]
            else:
                requests.append(request)
        if requests:
            answered.update(await self._engine.generate(requests))
        positions, rows = [], []
        for position, key in enumerate(keys):
            for row in sorted(answered[key], key=lambda r: r["sample_index"]):
                positions.append(position)
                rows.append(row)
        return frame.with_results(positions, rows)

    def _check(self, key: int, data: dict, frame: "_Frame") -> tuple[dict | None, dict | None]:
        """run's row checks, all but the uniqueness of ids (a stage sees one batch of the dataset)."""
        row_id = self._ids.new_id(key, frame.id_is_text)
        if data.get("id") is not None:
            try:
                row_id = check_id(data["id"])
            except RowError as e:
                return None, error_row(key, row_id, str(e))
        # the input's columns named like output columns: run's error ("reserved for the output")
        reserved = dict.fromkeys(frame.reserved_columns)
        return checked_request(key, row_id, data, reserved)

    def close(self) -> None:
        """Stop the engine thread and release the engine's worker processes."""
        self._engine.close()
        self.llm.close()

    def __del__(self):
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()


class _IdMaker:
    """Row keys (a counter of the actor's rows) and the ids of rows that have none.

    A generated id is "<actor>-<row>": the actor's random uuid4 (32 hex digits) and the row's number
    in that actor, so no two rows of a dataset, whichever actor or batch they went to, share one.
    Where the id column is numeric, the id must be an integer: the first 63 bits of a hash of that
    text (two of a million such ids collide with odds of about 5e-8)."""

    def __init__(self) -> None:
        self.actor = uuid.uuid4().hex
        self._next = 0
        self._lock = threading.Lock()  # (batches run on one event loop; a plain call may come from any thread)

    def keys(self, count: int) -> list[int]:
        with self._lock:
            first, self._next = self._next, self._next + count
        return list(range(first, first + count))

    def new_id(self, key: int, text: bool) -> str | int:
        name = f"{self.actor}-{key}"
        if text:
            return name
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


# --- the engine's thread ------------------------------------------------------------------------


@dataclass
class _Batch:
    """One __call__'s requests in the engine: its results so far, and the future that gets them."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    expected: dict[int, int]  # row key -> results the request gets (n samples)
    results: dict[int, list[dict]] = field(default_factory=dict)
    left: int = 0  # requests not finished

    def add(self, key: int, row: dict) -> bool:
        """Take a result; True when the request is finished (all its samples, or an error row)."""
        rows = self.results.setdefault(key, [])
        rows.append(row)
        return row.get("finish_reason") == "error" or len(rows) == self.expected[key]


class _EngineThread:
    """`llm.generate` on one thread for the actor's life, fed by a queue of requests from any number
    of batches at once; each batch's results are handed back to its event loop when all are in."""

    IDLE_WAIT_S = 1.0  # how often an idle engine thread checks whether it was closed

    def __init__(self, llm: LLM, sampling: SamplingParams):
        self.llm = llm
        self.sampling = sampling
        self._queue: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._owner: dict[int, _Batch] = {}  # row key -> its batch, while the request is not finished
        self._in_engine = 0  # requests the engine took and did not finish
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first batch

    async def generate(self, requests: list[dict]) -> dict[int, list[dict]]:
        """The results of `requests` (checked rows, each with a unique ROW_KEY), by row key."""
        loop = asyncio.get_running_loop()
        default_n = self.sampling.n
        batch = _Batch(loop, loop.create_future(), {r[ROW_KEY]: samples_of(r, default_n) for r in requests})
        batch.left = len(requests)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="batchgen-ray-engine", daemon=True)
                self._thread.start()
            for request in requests:
                self._owner[request[ROW_KEY]] = batch
                self._queue.put(request)
        return await batch.future

    def close(self) -> None:
        self._closed.set()

    def _requests(self):
        """The engine's source: queued requests; None ("nothing right now") while it has work and the
        queue is empty; a blocking wait while it has none. Ends when closed."""
        while not self._closed.is_set():
            try:
                request = self._queue.get(block=self._in_engine == 0, timeout=self.IDLE_WAIT_S)
            except queue.Empty:
                if self._in_engine:
                    yield None
                continue
            with self._lock:
                self._in_engine += 1
            yield request

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                for result in self.llm.generate(self._requests(), self.sampling):
                    self._finish(result)
            except Exception as e:  # a broken device, not a bad row: fail the batches it held
                log.error("the engine failed (%s: %s); its batches fail", type(e).__name__, e, exc_info=True)
                self._fail_all(e)

    def _finish(self, result: dict) -> None:
        key = result.pop(ROW_KEY, None)
        with self._lock:
            batch = self._owner.get(key)
            if batch is None:  # a later sample of a request that ended with an error row
                log.debug("result for a finished request (id %r) dropped", result.get("id"))
                return
            if not batch.add(key, result):
                return
            del self._owner[key]
            self._in_engine -= 1
            batch.left -= 1
            if batch.left == 0:
                batch.loop.call_soon_threadsafe(_settle, batch.future, batch.results)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            while True:  # requests not yet taken belong to the batches failed here
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            for batch in {id(b): b for b in self._owner.values()}.values():
                batch.loop.call_soon_threadsafe(_fail, batch.future, error)
            self._owner.clear()
            self._in_engine = 0


def _settle(future: asyncio.Future, results: dict) -> None:
    if not future.done():
        future.set_result(results)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


# --- batch formats ------------------------------------------------------------------------------


class _Frame:
    """One input batch in any of Ray's formats: the fields the engine reads, as plain Python values,
    and the output batch in the same format."""

    def __init__(self, batch, columns: list[str], num_rows: int, id_is_text: bool):
        self.batch = batch
        self.columns = columns
        self.num_rows = num_rows
        self.id_is_text = id_is_text  # the output's id column is text (else int64)
        self.reserved_columns = [c for c in columns if c in RESERVED]
        # the input columns a result column takes the place of (`id`, and opt-in outputs like logprobs)
        self.replaced = {"id", *OUTPUT_TYPES, *OPTIONAL_OUTPUT_TYPES}

    @staticmethod
    def of(batch) -> "_Frame":
        if isinstance(batch, pa.Table):
            return _ArrowFrame(batch)
        if isinstance(batch, pd.DataFrame):
            return _PandasFrame(batch)
        if isinstance(batch, dict):
            return _NumpyFrame(batch)
        raise TypeError(f"Generate takes a dict of numpy arrays, a pandas DataFrame or a pyarrow Table, "
                        f"got {type(batch).__name__}")

    def request_fields(self) -> list[dict]:
        """Each row's fields that the engine reads (`id`, the prompt, the sampling fields)."""
        names = [c for c in self.columns if c in KNOWN_FIELDS]
        values = {name: self.column_values(name) for name in names}
        return [{name: values[name][i] for name in names} for i in range(self.num_rows)]

    def column_values(self, name: str) -> list:
        raise NotImplementedError

    def result_columns(self, rows: list[dict]) -> dict[str, pa.Array]:
        """The output columns of `rows`: `id`, run's output columns and the opt-in ones this input
        asks for (a column of that name), typed as in run's output file."""
        ids = [r["id"] for r in rows]
        id_column = pa.array([str(v) for v in ids] if self.id_is_text else ids,
                             type=pa.string() if self.id_is_text else pa.int64())
        columns = {"id": id_column}
        wanted = {**OUTPUT_TYPES, **{n: t for n, t in OPTIONAL_OUTPUT_TYPES.items() if n in self.columns}}
        for name, kind in wanted.items():
            values = [r.get(name) for r in rows]
            if name == "output_token_ids":
                values = [[] if v is None else [int(t) for t in v] for v in values]
            columns[name] = pa.array(values, type=kind)
        return columns

    def kept_columns(self) -> list[str]:
        """The input columns that pass through: all but those a result column replaces."""
        return [c for c in self.columns if c not in self.replaced]

    def with_results(self, positions: list[int], rows: list[dict]):
        raise NotImplementedError


class _ArrowFrame(_Frame):
    def __init__(self, table: pa.Table):
        id_type = table.schema.field("id").type if "id" in table.column_names else pa.string()
        text = pa.types.is_string(id_type) or pa.types.is_large_string(id_type)
        super().__init__(table, table.column_names, table.num_rows, text)

    def column_values(self, name: str) -> list:
        return self.batch.column(name).to_pylist()

    def with_results(self, positions, rows) -> pa.Table:
        kept = self.batch.select(self.kept_columns()).take(pa.array(positions, type=pa.int64()))
        results = self.result_columns(rows)
        return pa.table({"id": results.pop("id"), **{c: kept.column(c) for c in kept.column_names}, **results})


class _PandasFrame(_Frame):
    def __init__(self, frame: pd.DataFrame):
        text = "id" not in frame.columns or not pd.api.types.is_numeric_dtype(frame["id"].dtype)
        super().__init__(frame, list(frame.columns), len(frame), text)

    def column_values(self, name: str) -> list:
        return [plain(v) for v in self.batch[name].tolist()]

    def with_results(self, positions, rows) -> pd.DataFrame:
        out = self.batch[self.kept_columns()].iloc[positions].reset_index(drop=True)
        results = self.result_columns(rows)
        # Arrow-backed columns: Ray turns them back into Arrow with their types (list<int32>, ...)
        columns = {n: pd.Series(a, dtype=pd.ArrowDtype(a.type)) for n, a in results.items()}
        out.insert(0, "id", columns.pop("id"))
        for name, column in columns.items():
            out[name] = column
        return out


class _NumpyFrame(_Frame):
    def __init__(self, batch: dict):
        sizes = {len(v) for v in batch.values()}
        if len(sizes) > 1:
            raise ValueError(f"the batch's columns have different lengths: {sorted(sizes)}")
        ids = batch.get("id")
        text = ids is None or np.asarray(ids).dtype.kind not in "iufb"
        super().__init__(batch, list(batch), sizes.pop() if sizes else 0, text)

    def column_values(self, name: str) -> list:
        return [plain(v) for v in self.batch[name]]

    def with_results(self, positions, rows) -> dict:
        index = np.asarray(positions, dtype=np.int64)
        out = {"id": None, **{c: _kept_column(np.asarray(self.batch[c])[index]) for c in self.kept_columns()}}
        for name, column in self.result_columns(rows).items():
            out[name] = _numpy_column(column)
        return out


def _kept_column(column: np.ndarray) -> np.ndarray:
    """An input column going out again. Ray gives a list column as an object array of numpy arrays,
    and turns such an array back into its tensor type, whose batches do not concatenate where one
    holds only nulls: its lists go back as Python lists (an Arrow list column again)."""
    if column.ndim > 1:  # (a batch made by hand: lists of one length as a 2-d array)
        return _object_array(column.tolist())
    if column.dtype != object or not any(isinstance(v, np.ndarray) for v in column):
        return column
    return _object_array([plain(v) if isinstance(v, np.ndarray) else v for v in column])


def _numpy_column(column: pa.Array) -> np.ndarray:
    """A numpy column Ray turns back into the Arrow type it came from: scalars as numpy dtypes; lists
    as Python lists in an object array (numpy arrays there would become Ray's tensor type)."""
    if pa.types.is_list(column.type) or pa.types.is_string(column.type):
        return _object_array(column.to_pylist())
    return column.to_numpy(zero_copy_only=False)


def _object_array(values: list) -> np.ndarray:
    """A 1-d object array of `values` (np.array would make lists of one length a 2-d array)."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def plain(value: Any) -> Any:
    """A value of a numpy or pandas batch as the plain Python value the engine's checks expect:
    arrays as lists, numpy scalars as Python ones, NaN and pandas' NA as None (how they show a null)."""
    if value is None or value is pd.NA:
        return None
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
