"""The engine loop: requests in, one scheduled batch per step through the runner, finished
sequences out with their text and metrics."""
from __future__ import annotations

import logging
import time
import weakref

from transformers import AutoTokenizer

from batchgen.config import EngineConfig
from batchgen.forward.parallel import SINGLE
from batchgen.engine.request import (
    PreparedRequest, RequestError, RequestPreparer, Sequence, Status, make_samples,
)
from batchgen.engine.runner import ModelRunner, StepOutput
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.structured import GrammarError, StructuredDecoding, field_name
from batchgen.engine.tp_workers import TPWorkers, tp_device
from batchgen.models.model_config import load_model_config
from batchgen.models.resolve import resolve_model_dir
from batchgen.sampling_params import SamplingParams
from batchgen.schema import KNOWN_FIELDS, error_result
from batchgen.token_text import token_text_of

log = logging.getLogger("batchgen")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_cfg = load_model_config(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=config.trust_remote_code)
        self._token_text = token_text_of(self.tokenizer)  # top_logprobs' token strings
        self.workers: TPWorkers | None = None  # ranks 1..N-1 under tensor parallelism
        tp = SINGLE
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
        self.kv = self.runner.kv
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.runner.max_num_batched_tokens,
                                   prefix_caching=config.enable_prefix_caching)
        # a request longer than this can never run: the model's length, or the whole pool
        self.max_request_len = min(self.runner.max_model_len, self.kv.num_slots)
        self.eos_ids = self.model_cfg.eos_token_ids or (
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        )
        self.structured = StructuredDecoding(
            self.tokenizer, self.model_cfg.vocab_size, self.eos_ids, config.max_num_seqs,
            pin_memory=self.runner.device.type == "cuda",
        )
        self.in_flight: StepOutput | None = None  # the launched step not yet read back
        self.generated_tokens = 0  # tokens sampled so far, unfinished rows' included: progress displays read it
        log.info("engine ready: %s", self.describe())

    def describe(self) -> dict:
        return {
            "model": str(self.model_dir),
            "architecture": self.model_cfg.architecture,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": str(self.runner.device),
            "max_model_len": self.runner.max_model_len,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.runner.max_num_batched_tokens,
            "kv_cache_tokens": self.kv.num_slots,
            "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "tensor_parallel_all_reduce": self.runner.tp.all_reduce_path,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "seed": self.config.seed,
        }

    def request_preparer(self, defaults: SamplingParams) -> RequestPreparer:
        """Rows -> PreparedRequest or RequestError each: the part of a request any thread may do."""
        return RequestPreparer(defaults, self.config.seed, self.tokenizer, self.model_cfg.vocab_size,
                               self.max_request_len)

    def prepare(self, row: dict, defaults: SamplingParams) -> PreparedRequest:
        """One row on the engine's thread; raises RequestError with a one-line reason."""
        prepared, = self.request_preparer(defaults)([row])
        if not isinstance(prepared, PreparedRequest):
            raise prepared
        return prepared

    def make_sequence(self, row: dict, defaults: SamplingParams) -> Sequence:
        """Validate a request row -> its sequence (sample 0); raises RequestError with a one-line reason."""
        seq, = self.sequences(self.prepare(row, defaults), [0])
        return seq

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
        """End the tensor-parallel workers, if any (also done when the engine is collected)."""
        if self.workers is not None:
            self._finalizer()

    def step(self) -> list[Sequence]:
        """Schedule and launch one batch, then read back the previous one while the device runs
        this one; -> the sequences that finished in the previous batch."""
        if self.workers is None:
            return self._step()
        self.workers.check()
        try:
            return self._step()
        except Exception as e:  # a rank failed: raise which and why, with every worker ended
            self.workers.fail(e)

    def _step(self) -> list[Sequence]:
        """docs/STEP.md: launch step N+1's forward; sample it at once unless a sampler is
        constrained; read back step N; then the constrained samplers' masks (which need N's
        tokens) and step N+1's sampling."""
        batch = self.scheduler.schedule()
        logits = launched = None
        samplers = scored = None
        if batch is not None:
            now = time.monotonic()
            for seq in batch.seqs:
                if seq.first_scheduled is None:
                    seq.first_scheduled = now
            inputs, samplers, scored = self.runner.step_inputs(batch)
            if self.workers is not None:
                self.workers.send(inputs)  # the other ranks run the same step
            logits = self.runner.launch_forward(inputs, self.in_flight, self.runner.logits_dtype(samplers, scored))
            if not any(seq.structured is not None for seq in samplers):
                launched = self.runner.launch_sampling(logits, samplers, scored,
                                                       from_shards=bool(inputs.sample_from_shards))
        finished = self._read_back(self.in_flight) if self.in_flight is not None else []
        if logits is not None and launched is None:  # constrained: N's tokens are accepted now
            rows, bitmask, ended = self.structured.fill(samplers)
            for seq in ended:
                self._end_by_grammar(seq)
                finished.append(seq)
            launched = self.runner.launch_sampling(logits, samplers, scored, (rows, bitmask) if rows else None)
        self.in_flight = launched
        return finished

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
        for seq, token in zip(step.samplers, tokens):
            seq.num_pending -= 1
            if seq.status is Status.FINISHED:  # its last token is known already: this one is surplus
                continue
            seq.token_ids.append(token)
            self.generated_tokens += 1
            if seq.first_token is None:
                seq.first_token = now
            if (seq.matcher is not None and self._check_grammar(seq, token)) or self._check_finished(seq, token):
                seq.finished_at = now
                self.scheduler.finish(seq)
                finished.append(seq)
        return finished

    def _check_grammar(self, seq: Sequence, token: int) -> bool:
        """Its grammar accepts the new token (exactly once) -> whether that ended the sequence: a
        stop token where the grammar is complete (finish_reason stop, even under ignore_eos)."""
        if not self.structured.accept(seq, token):  # the mask allowed it: only a bug gets here
            seq.error = f"{field_name(seq.structured)}: generated token {token} was rejected by the grammar"
            return True
        if seq.matcher.is_terminated():
            seq.finish_reason, seq.text_tokens = "stop", len(seq.output_ids) - 1  # without the stop token
            return True
        return False

    def _end_by_grammar(self, seq: Sequence) -> None:
        """A sequence that fill() ended: its grammar failed to compile (seq.error), or is complete
        and allows only a stop token next (finish_reason stop, without sampling it)."""
        now = time.monotonic()
        if seq.error is None:
            seq.finish_reason, seq.text_tokens = "stop", len(seq.output_ids)
        seq.first_token = seq.first_token or now
        seq.finished_at = now
        self.scheduler.finish(seq)

    def abort_all(self, clear_cache: bool = False) -> None:
        """Drop every request, freeing its slots. clear_cache: empty the prefix cache too (after a
        failure: a step may have been scheduled, its prompts cached, and never launched)."""
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)
        self.scheduler.waiting.clear()
        self.in_flight = None
        if clear_cache and self.scheduler.cache is not None:
            self.scheduler.cache.clear()

    def _check_finished(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        num_out = len(seq.token_ids) - seq.num_prompt  # known on the host (pending ones not counted)
        if token in seq.stop_ids and num_out >= params.min_tokens:
            seq.finish_reason, seq.text_tokens = "stop", num_out - 1  # the text leaves out the stop token
            return True
        if params.stop and num_out >= params.min_tokens and (
            num_out == params.min_tokens or self._stop_in_tail(seq)
        ):  # the whole text only when it may hold a stop string: it is decoded once, not every step
            text = self.decode(seq.output_ids)
            cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.finish_reason, seq.text = "stop", text[:cut]
                return True
        if num_out >= params.max_tokens:
            seq.finish_reason, seq.text_tokens = "length", num_out
            return True
        return False

    def _stop_in_tail(self, seq: Sequence) -> bool:
        """Whether a stop string shows in the text of the last few tokens. Checked every step, a stop
        string first appears ending in the newest token, within its last 4 * len(stop) tokens (a
        character takes at most 4 byte tokens); 8 more keep the tail's first token, whose decoding
        may differ from its decoding in context (a dropped leading space), clear of it."""
        window = 4 * max(len(s) for s in seq.params.stop) + 8
        tail = self.decode(seq.token_ids[max(seq.num_prompt, len(seq.token_ids) - window) :])
        return any(s in tail for s in seq.params.stop)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_texts(self, seqs: list[Sequence]) -> list[Sequence]:
        """Fill in the text of finished sequences that have none yet (those that ended by a stop string
        have theirs), in one batched call; any thread may run it. -> seqs"""
        todo = [seq for seq in seqs if seq.text is None]
        if todo:
            ids = [seq.token_ids[seq.num_prompt : seq.num_prompt + seq.text_tokens] for seq in todo]
            for seq, text in zip(todo, self.tokenizer.batch_decode(ids, skip_special_tokens=True)):
                seq.text = text
        return seqs


def result_row(seq: Sequence) -> dict:
    """DESIGN.md's output row of a finished sequence."""
    if seq.error is not None:  # failed in the engine (its grammar): an error row like a refused one
        return error_result(seq.id, seq.error, seq.extras)
    out_ids = seq.output_ids
    queue = seq.first_scheduled - seq.arrival
    ttft = seq.first_token - seq.arrival
    prefill = seq.first_token - seq.first_scheduled
    decode = seq.finished_at - seq.first_token
    return {
        "id": seq.id,
        **seq.extras,
        "sample_index": seq.sample_index,
        "text": seq.text,
        "output_token_ids": out_ids,
        "finish_reason": seq.finish_reason,
        "error": None,
        "prompt_tokens": seq.num_prompt,
        "completion_tokens": len(out_ids),
        "cached_prompt_tokens": seq.cached_prompt_tokens,
        "num_preemptions": seq.num_preemptions,
        "queue_s": queue,
        "ttft_s": ttft,
        "prefill_s": prefill,
        "decode_s": decode,
        "e2e_s": seq.finished_at - seq.arrival,
        "decode_tokens_per_s": (len(out_ids) - 1) / decode if decode > 0 and len(out_ids) > 1 else None,
        **({"logprobs": seq.logprobs} if seq.logprobs is not None else {}),
        **({"prompt_logprobs": seq.prompt_logprobs} if seq.prompt_logprobs is not None else {}),
        **({"top_logprobs": seq.top_logprobs} if seq.top_logprobs is not None else {}),
    }


def error_row(row, message: str) -> dict:
    """The error result of a request row the engine refused, its extra keys carried through."""
    if not isinstance(row, dict):
        return error_result(None, message)
    return error_result(row.get("id"), message, {k: v for k, v in row.items() if k not in KNOWN_FIELDS})
