"""The engine: the host's loop. Request rows in, finished rows out: rows are checked and tokenized
ahead of the loop, the scheduler plans each step, the executor (model runner) runs it on the device,
and finished sequences are judged, decoded behind the loop and turned into result rows."""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

from transformers import AutoTokenizer

from batchgen.config import EngineConfig
from batchgen.engine.finish import FinishRules, error_row, result_row
from batchgen.engine.kv_slots import KVSlots
from batchgen.engine.packer import pack
from batchgen.engine.request import PreparedRequest, RequestError, RequestPreparer, Sequence, Status, make_samples
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.step_plan import plan_step
from batchgen.engine.structured import GrammarError, StructuredDecoding
from batchgen.engine.tokenizer_pool import OrderedWorker
from batchgen.executor.model_runner import ModelRunner
from batchgen.executor.sampling import StepOutput
from batchgen.executor.tp_workers import TPWorkers, tp_device
from batchgen.models.model_config import load_model_config
from batchgen.models.quantization import describe_scheme, resolve_scheme
from batchgen.models.resolve import resolve_model_dir
from batchgen.parallel.tensor_parallel import SINGLE
from batchgen.sampling_params import SamplingParams
from batchgen.schema import SAMPLES_KEY
from batchgen.token_text import token_text_of

log = logging.getLogger("batchgen")

CLOSED = ("this LLM was closed (close() or the end of its with block freed its model and KV cache); "
          "create a new LLM(...) to generate again")
_END = object()
PREPARE_BATCH = 64  # rows per tokenizer call: enough for a batched encode, few enough to start at once


class EngineClosedError(RuntimeError):
    """The engine was closed: its model and KV pool are freed."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_cfg = load_model_config(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=config.trust_remote_code)
        self._token_text = token_text_of(self.tokenizer)  # top_logprobs' token strings
        self.workers: TPWorkers | None = None  # ranks 1..N-1 under tensor parallelism
        tp = SINGLE
        if config.batch_invariant and config.tensor_parallel_size > 1:
            log.warning("--batch-invariant: the sums over --tensor-parallel-size %d GPUs are not pinned to one "
                        "order, so a row's tokens may still follow its batch", config.tensor_parallel_size)
        if config.tensor_parallel_size > 1:
            self.workers = TPWorkers(config, self.model_dir, tp_device(config))
            self._finalizer = weakref.finalize(self, self.workers.close)  # collected or exiting: end them
            tp = self.workers.tp
        try:
            self.runner = ModelRunner(config, self.model_dir, self.model_cfg, tp)
        except Exception as e:
            if self.workers is None:
                raise
            self.workers.fail(e)
        if self.workers is not None:  # step() reads results back through StepOutput.read(check)
            self.workers.runner_ready(self.runner.graphs.release if self.runner.graphs is not None else None)
        self.kv = KVSlots(self.runner.kv.num_slots, self.runner.max_num_seqs)
        self.scheduler = Scheduler(self.kv, self.runner.max_num_seqs, self.runner.max_num_batched_tokens,
                                   prefix_caching=config.enable_prefix_caching)
        # a request longer than this can never run: the model's length, or the whole pool
        self.max_request_len = min(self.runner.max_model_len, self.kv.num_slots)
        self.eos_ids = self.model_cfg.eos_token_ids or (
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        )
        self.structured = StructuredDecoding(
            self.tokenizer, self.model_cfg.vocab_size, self.eos_ids, self.runner.max_num_seqs,
            pin_memory=self.runner.device.type == "cuda",
        )
        self.finish = FinishRules(self.tokenizer, self.structured)
        self.in_flight: StepOutput | None = None  # the launched step not yet read back
        self.closed = False  # close() freed the model and the KV pool
        self.stats: dict = {}  # the last generate()'s: generation_seconds, prompt_tokens, output_tokens
        self.generated_tokens = 0  # tokens sampled so far, unfinished rows' included: progress displays read it
        log.info("engine ready: %s", self.describe())

    def describe(self) -> dict:
        return {
            "model": str(self.model_dir),
            "architecture": self.model_cfg.architecture,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": str(self.runner.device),
            "max_model_len": self.runner.max_model_len,
            "max_num_seqs": self.runner.max_num_seqs,
            "max_num_batched_tokens": self.runner.max_num_batched_tokens,
            "kv_cache_tokens": self.kv.num_slots,
            "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "quantization": describe_scheme(resolve_scheme(self.model_cfg.quantization, self.config.quantization)),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "tensor_parallel_all_reduce": self.runner.tp.all_reduce_path,
            "expert_parallel": self.runner.tp.expert_parallel and self.model_cfg.num_experts > 0,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "seed": self.config.seed,
            "batch_invariant": self.config.batch_invariant,
            "load_format": self.config.load_format,  # dummy: random weights (a benchmark), not the checkpoint
            "cpu_threads": self.config.cpu_threads if self.config.cpu_threads is not None else "auto",
            "pdl": self.config.pdl,
            "symmetric_all_reduce": self.config.symmetric_all_reduce,
        }

    def request_preparer(self, defaults: SamplingParams) -> RequestPreparer:
        """Rows -> PreparedRequest or RequestError each: the part of a request any thread may do."""
        return RequestPreparer(defaults, self.config.seed, self.tokenizer, self.model_cfg.vocab_size,
                               self.max_request_len)

    def sequences(self, prepared: PreparedRequest, indices: list[int] | None = None) -> list[Sequence]:
        """A prepared request -> the sequences of its n samples (those of `indices`, default all).
        A constrained request's grammar starts compiling on a worker thread (once per distinct
        spec); RequestError when it cannot."""
        seqs = make_samples(prepared, self.eos_ids, indices)
        for seq in seqs:  # every constrained sequence is attached here: fill() expects its grammar
            if seq.structured is not None:
                try:
                    self.structured.attach(seq)
                except GrammarError as e:
                    raise RequestError(str(e)) from None
        return seqs

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def close(self) -> None:
        """End the tensor-parallel workers, if any, and free the model, the KV pool and the CUDA graphs.
        Idempotent. Dropping the engine does the same: nothing in it holds a reference cycle, so its memory
        goes with the last reference (the workers end by a finalizer)."""
        if self.closed:
            return
        self.closed = True
        if self.workers is not None:
            self._finalizer()
        self.abort_all()
        self.runner.close()

    # ---- the loop ------------------------------------------------------------------------------
    def generate(self, requests: Iterable[dict], defaults: SamplingParams,
                 stop_event: threading.Event | None = None, threaded: bool = True) -> Iterator[dict]:
        """Yield one result row per request (LLM.generate says how), as each finishes. threaded:
        tokenize and detokenize in worker threads beside the loop (False: on this thread, between steps).
        EngineClosedError once the engine is closed."""
        source = iter(requests)
        lookahead = 4 * self.runner.max_num_seqs  # waiting requests the scheduler can choose from
        # Rows are checked and tokenized ahead of the loop, finished texts decoded behind it.
        ahead = OrderedWorker(self.request_preparer(defaults), "batchgen-tokenize", threaded)
        behind = OrderedWorker(self.finish.decode_texts, "batchgen-detokenize", threaded)
        exhausted, index = False, 0
        joining = False  # the step after the device started on one batch of rows: every row read joins
        first_admit = last_result = None
        prompt_tokens = output_tokens = 0
        self.stats = {}
        failed = False
        # With nothing running, the device starts on the oldest batch of rows alone; the batches read after
        # it are held, and start on the worker once that step is launched: the worker's Python would hold
        # the GIL while this thread schedules the device's first step.
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
                starting = not self.has_work() and not ahead.pending
                rows = []
                while not exhausted and len(self.scheduler.waiting) + ahead.pending + len(rows) < lookahead:
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
                # them together. Else take the ones ready; the rest join a later step.
                if not self.has_work():
                    taken, joining = ahead.take(oldest=True), True
                else:
                    taken, joining = ahead.take(wait_all=joining), False
                fresh = []
                for row, prepared in taken:
                    if isinstance(prepared, RequestError):  # a bad row
                        yield error_row(row, str(prepared))
                        continue
                    try:
                        fresh.extend(self.sequences(prepared, row.get(SAMPLES_KEY)))
                    except RequestError as e:  # a constraint that cannot compile
                        yield error_row(row, str(e))
                for seq in pack(fresh):
                    self.add(seq)
                if stop_event is not None and stop_event.is_set():
                    yield from results(behind.take(wait_all=True))  # finished ones are not dropped
                    break
                if self.has_work():
                    first_admit = first_admit or time.monotonic()
                    behind.submit(self.step())
                ahead.release()  # (starting: its step is launched)
                yield from results(behind.take(wait_all=not self.has_work()))
                if self.closed:  # (closed while this generator was suspended: its rows were dropped)
                    raise EngineClosedError(CLOSED)
                if exhausted and not self.has_work() and not ahead.pending:
                    break
        except Exception:
            failed = True
            raise
        finally:
            ahead.close()
            behind.close()
            # a stop, an error, or a consumer that quit early: free every slot (and after an error the
            # prefix cache too: it may hold prompts of a step that was never launched)
            self.abort_all(clear_cache=failed)
            gen_s = (last_result - first_admit) if first_admit and last_result else 0.0
            self.stats = {"generation_seconds": gen_s, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedule and launch one batch, then read back the previous one while the device runs
        this one; -> the sequences that finished in the previous batch."""
        if self.closed:
            raise EngineClosedError(CLOSED)
        if self.workers is None:
            return self._step()
        self.workers.check()
        try:
            return self._step()
        except Exception as e:  # a rank failed: raise which and why, with every worker ended
            self.workers.fail(e)

    def _step(self) -> list[Sequence]:
        """docs/STEP.md: launch step N+1's forward; sample it at once unless a sampler is
        constrained or penalized; read back step N; then the constrained samplers' masks (which need
        N's tokens) and step N+1's sampling (whose penalties need them too)."""
        batch = self.scheduler.schedule()
        runner = self.runner
        logits = launched = None
        samplers = scored = None
        if batch is not None:
            now = time.monotonic()
            for seq in batch.seqs:
                if seq.first_scheduled is None:
                    seq.first_scheduled = now
            inputs, samplers, scored = plan_step(batch, runner.tp.size)
            if self.workers is not None:
                self.workers.send(inputs)  # the other ranks run the same step
            previous = self.in_flight.tokens if self.in_flight is not None else None
            logits = runner.launch_forward(inputs, previous, runner.logits_dtype(samplers, scored))
            if not any(seq.samples_late for seq in samplers):
                launched = self._sample(logits, samplers, scored, from_shards=bool(inputs.sample_from_shards))
        finished = self._read_back(self.in_flight) if self.in_flight is not None else []
        if logits is not None and launched is None:  # constrained or penalized: N's tokens are known now
            rows, bitmask, ended = self.structured.fill(samplers)
            for seq in ended:
                self.finish.end_by_grammar(seq)
                self.scheduler.finish(seq)
                finished.append(seq)
            launched = self._sample(logits, samplers, scored, (rows, bitmask) if rows else None)
        self.in_flight = launched
        return finished

    def _sample(self, logits, samplers: list[Sequence], scored: list, mask=None, from_shards=False) -> StepOutput:
        """Launch the sampling of a step's logits; each sampler's token is pending until read back."""
        launched = self.runner.sampler.launch(logits, samplers, scored, mask, from_shards)
        for i, seq in enumerate(samplers):
            seq.logits_row = i
            seq.num_pending += 1
        return launched

    def _read_back(self, step: StepOutput) -> list[Sequence]:
        tokens, token_logprobs, prompt_logprobs = step.read(self.workers.check if self.workers else None)
        for seq, count in step.scored:
            seq.prompt_logprobs.extend(prompt_logprobs[:count])
            prompt_logprobs = prompt_logprobs[count:]
        for i, value in zip(step.wanting, token_logprobs):
            if step.samplers[i].status is not Status.FINISHED:  # (a surplus token's value is not kept)
                step.samplers[i].logprobs.append(value)
        for i, top in step.top_logprobs:
            seq = step.samplers[i]
            if seq.status is not Status.FINISHED:
                seq.top_logprobs.append([
                    {"token_id": t, "token": self._token_text(t), "logprob": lp} for t, lp in top
                ])
        now = time.monotonic()
        finished = []
        self.generated_tokens += len(tokens)  # (a finished sequence's surplus token counted too: progress only)
        for seq, token in zip(step.samplers, tokens):
            seq.num_pending -= 1
            if seq.status is Status.FINISHED:  # its last token is known already: this one is surplus
                continue
            seq.token_ids.append(token)
            if seq.first_token is None:
                seq.first_token = now
            if self.finish.ends(seq, token):
                seq.finished_at = now
                self.scheduler.finish(seq)
                finished.append(seq)
        return finished

    def abort_all(self, clear_cache: bool = False) -> None:
        """Drop every request, freeing its slots. clear_cache: empty the prefix cache too (after a
        failure: a step may have been scheduled, its prompts cached, and never launched)."""
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)
        self.scheduler.waiting.clear()
        self.in_flight = None
        if clear_cache and self.scheduler.cache is not None:
            self.scheduler.cache.clear()
