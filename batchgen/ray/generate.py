"""Generate: the map_batches callable class. Its options, the row checks, the ids of rows without one."""
from __future__ import annotations

import dataclasses
import hashlib
import threading
import uuid

import pandas as pd
import pyarrow as pa

from batchgen.config import EngineConfig
from batchgen.io.rows import RowError, check_id, checked_request, error_row
from batchgen.llm import LLM
from batchgen.ray.batches import Frame
from batchgen.ray.engine_thread import EngineThread
from batchgen.sampling_params import SamplingParams

# `run`'s sampling options that are engine settings (the job seed, where the defaults come from)
SAMPLING_ENGINE_OPTIONS = ("seed", "generation_config")
SAMPLING_OPTIONS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "seed")


class Generate:
    """batchgen's engine as a map_batches stage. `model`: a local HF directory (None: the embedded
    default model); `sampling`: `batchgen run`'s sampling options by name (max_tokens, temperature,
    top_p, top_k, min_p, the penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, stop, stop_token_ids,
    ignore_eos, n, seed, response_format, structured_outputs, generation_config); the rest: `LLM`'s engine
    options (EngineConfig's fields).
    A sampling option not given comes from the model's generation_config.json, else batchgen's
    built-in, as with `run`. ValueError for a bad option."""

    def __init__(self, model: str | None = None, sampling: dict | None = None, **engine_options):
        given, engine_options = self.check_options(model, sampling, **engine_options)
        self.llm = LLM(model=model, **engine_options)
        # run's resolution: an option given, else the model's generation_config.json, else built-in
        self.sampling = self.llm.get_default_sampling_params(**given)
        self._engine = EngineThread(self.llm, self.sampling)
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
        frame = Frame.of(batch)
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

    def _check(self, key: int, data: dict, frame: Frame) -> tuple[dict | None, dict | None]:
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


