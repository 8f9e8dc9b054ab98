"""The Python API: LLM(model=None, **engine_options).generate(requests)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from batchgen.config import EngineConfig
from batchgen.engine.engine import LLMEngine, error_row, result_row
from batchgen.engine.packer import pack
from batchgen.engine.request import RequestError
from batchgen.sampling_params import SamplingParams
from batchgen.version import __version__

_END = object()


class LLM:
    """An engine on one model. `model=None` is the embedded default model (SmolLM2-135M-Instruct).

    >>> llm = LLM(max_num_seqs=64)
    >>> for result in llm.generate([{"id": 1, "prompt": "Hello"}], SamplingParams(max_tokens=8)):
    ...     print(result["id"], result["text"])
    """

    def __init__(self, model: str | None = None, **engine_options):
        self.config = EngineConfig(model=model, **engine_options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.stats: dict = {}

    def close(self) -> None:
        """Release the engine's worker processes (tensor parallelism); also done when the LLM is
        collected or the interpreter exits."""
        self.engine.close()

    def describe(self) -> dict:
        return {**self.engine.describe(), "batchgen_version": __version__}

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
        row at once and affects no other."""
        defaults = sampling or SamplingParams()
        engine = self.engine
        source = iter(requests)
        lookahead = 4 * self.config.max_num_seqs  # waiting requests the scheduler can choose from
        exhausted, index = False, 0
        first_admit = last_result = None
        prompt_tokens = output_tokens = 0
        self.stats = {}
        failed = False
        try:
            while True:
                fresh = []
                while not exhausted and len(engine.scheduler.waiting) + len(fresh) < lookahead:
                    row = next(source, _END)
                    if row is _END:
                        exhausted = True
                        break
                    if row is None:  # a live source with nothing right now: run what we have
                        break
                    if isinstance(row, dict) and row.get("id") is None:
                        row = {**row, "id": index}
                    index += 1
                    try:
                        fresh.extend(engine.make_sequences(row, defaults))
                    except RequestError as e:
                        yield error_row(row, str(e))
                for seq in pack(fresh):
                    engine.add(seq)
                if stop_event is not None and stop_event.is_set():
                    break
                if not engine.has_work():
                    if exhausted:
                        break
                    continue
                first_admit = first_admit or time.monotonic()
                for seq in engine.step():
                    last_result = time.monotonic()
                    prompt_tokens += seq.num_prompt
                    output_tokens += len(seq.output_ids)
                    yield result_row(seq)
        except Exception:
            failed = True
            raise
        finally:
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
