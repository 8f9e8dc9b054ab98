"""The Python API: LLM(model=None, **engine_options).generate(requests)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from batchgen.config import EngineConfig
from batchgen.engine.engine import LLMEngine, error_row, result_row
from batchgen.engine.packer import pack
from batchgen.engine.request import RequestError
from batchgen.models.generation_config import read_sampling_defaults
from batchgen.sampling_params import SamplingParams, resolve_defaults
from batchgen.schema import SAMPLES_KEY
from batchgen.engine.tokenizer_pool import OrderedWorker
from batchgen.version import __version__

_END = object()
PREPARE_BATCH = 64  # rows per tokenizer call: enough for a batched encode, few enough to start at once


class LLM:
    """An engine on one model. `model=None` is the embedded default model (SmolLM2-135M-Instruct).

    >>> llm = LLM(max_num_seqs=64)
    >>> params = llm.get_default_sampling_params().replace(max_tokens=8)  # the model's defaults, shorter
    >>> for result in llm.generate([{"id": 1, "prompt": "Hello"}], params):
    ...     print(result["id"], result["text"])
    """

    def __init__(self, model: str | None = None, tokenizer_pool: bool = True, **engine_options):
        """tokenizer_pool: tokenize and detokenize in worker threads beside the engine loop (False: on
        the engine's thread, between steps)."""
        self.config = EngineConfig(model=model, **engine_options)
        self.tokenizer_pool = tokenizer_pool
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.stats: dict = {}
        self._default_sampling: SamplingParams | None = None

    def close(self) -> None:
        """Release the engine's worker processes (tensor parallelism); also done when the LLM is
        collected or the interpreter exits."""
        self.engine.close()

    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far by this LLM, counted per step (a row's before it finishes)."""
        return self.engine.generated_tokens

    def describe(self) -> dict:
        return {**self.engine.describe(), "generation_config": self.config.generation_config,
                "batchgen_version": __version__}

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: batchgen's built-ins, overridden by the
        model's generation_config.json (temperature, top_p, top_k, max_new_tokens) unless the LLM was
        made with generation_config="none". A copy: change it with `.replace(max_tokens=64)`.
        ValueError if the model's file holds a value out of range."""
        if self._default_sampling is None:
            auto = self.config.generation_config == "auto"
            model_defaults = read_sampling_defaults(self.engine.model_dir) if auto else {}
            self._default_sampling, _ = resolve_defaults({}, model_defaults)
        return self._default_sampling.replace()

    def generate(
        self,
        requests: Iterable[dict],
        sampling: SamplingParams | None = None,
        stop_event: threading.Event | None = None,
    ) -> Iterator[dict]:
        """Yield one result row per request, as each finishes. Requests (DESIGN.md's input rows) are
        pulled lazily, only while the engine has room, so any number of them streams through in
        bounded memory. A live source (a queue) may yield None for "nothing right now": the engine
        keeps running what it has and asks again after the next step. A bad request yields an error
        row at once and affects no other. `sampling` holds the defaults a request's own fields
        override; None: get_default_sampling_params()."""
        defaults = sampling or self.get_default_sampling_params()
        engine = self.engine
        source = iter(requests)
        lookahead = 4 * self.config.max_num_seqs  # waiting requests the scheduler can choose from
        # Rows are checked and tokenized ahead of the loop, finished texts decoded behind it.
        ahead = OrderedWorker(engine.request_preparer(defaults), "batchgen-tokenize", self.tokenizer_pool)
        behind = OrderedWorker(engine.decode_texts, "batchgen-detokenize", self.tokenizer_pool)
        exhausted, index = False, 0
        joining = False  # the step after the device started on one batch of rows: every row read joins
        first_admit = last_result = None
        prompt_tokens = output_tokens = 0
        self.stats = {}
        failed = False

        # With nothing running, the device starts on the oldest batch of rows alone (below); the batches read
        # after it are held and start on the worker only once that step is launched: its Python would hold
        # the GIL while this thread schedules the step (a W-offline start on an H200: the first forward
        # 14-16 ms after the start with the rest prepared beside it, 6.5-10 without).
        starting = False

        def hand_over(batch: list) -> None:
            ahead.submit(batch, hold=starting and ahead.pending > 0)  # (the oldest batch is with the worker)

        def results(done: list[tuple]) -> list[dict]:
            nonlocal last_result, prompt_tokens, output_tokens
            for seq, _ in done:
                prompt_tokens += seq.num_prompt
                output_tokens += len(seq.output_ids)
            if done:
                last_result = time.monotonic()
            return [result_row(seq) for seq, _ in done]

        try:
            while True:
                starting = not engine.has_work() and not ahead.pending
                rows = []
                while not exhausted and len(engine.scheduler.waiting) + ahead.pending + len(rows) < lookahead:
                    row = next(source, _END)
                    if row is _END:
                        exhausted = True
                        break
                    if row is None:  # a live source with nothing right now: run what we have
                        break
                    if isinstance(row, dict) and row.get("id") is None:
                        row = {**row, "id": index}
                    index += 1
                    rows.append(row)
                    if len(rows) == PREPARE_BATCH:
                        hand_over(rows)
                        rows = []
                if rows:
                    hand_over(rows)
                # With nothing to run, the device starts on the oldest batch of rows; at the next step every
                # other row read by then joins (waited for while the device runs), so that the packer orders
                # them together, as when they were tokenized here. Else take the ones ready; the rest join
                # a later step.
                if not engine.has_work():
                    taken, joining = ahead.take(oldest=True), True
                else:
                    taken, joining = ahead.take(wait_all=joining), False
                fresh = []
                for row, prepared in taken:
                    if isinstance(prepared, RequestError):  # a bad row
                        yield error_row(row, str(prepared))
                        continue
                    try:
                        fresh.extend(engine.sequences(prepared, row.get(SAMPLES_KEY)))
                    except RequestError as e:  # a constraint that cannot compile
                        yield error_row(row, str(e))
                for seq in pack(fresh):
                    engine.add(seq)
                if stop_event is not None and stop_event.is_set():
                    yield from results(behind.take(wait_all=True))  # finished ones are not dropped
                    break
                if engine.has_work():
                    first_admit = first_admit or time.monotonic()
                    behind.submit(engine.step())
                ahead.release()  # (starting: its step is launched)
                yield from results(behind.take(wait_all=not engine.has_work()))
                if exhausted and not engine.has_work() and not ahead.pending:
                    break
        except Exception:
            failed = True
            raise
        finally:
            ahead.close()
            behind.close()
            # a stop, an error, or a consumer that quit early: free every slot (and after an error the
            # prefix cache too: it may hold prompts of a step that was never launched)
            engine.abort_all(clear_cache=failed)
            gen_s = (last_result - first_admit) if first_admit and last_result else 0.0
            self.stats = {"generation_seconds": gen_s, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}

    def generate_list(self, requests: Iterable[dict], sampling: SamplingParams | None = None) -> list[dict]:
        """All results, in the order of the requests (a request's n samples in order of sample_index)."""
        requests = list(requests)
        ids = [r.get("id", i) if isinstance(r, dict) else i for i, r in enumerate(requests)]
        by_id: dict = {}
        for r in self.generate(requests, sampling):
            by_id.setdefault(r["id"], []).append(r)
        return [r for i in ids for r in sorted(by_id[i], key=lambda r: r["sample_index"])]
