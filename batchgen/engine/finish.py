"""When a sequence ends (a stop token, a stop string, max_tokens, or its grammar), its text, and the
output row of a finished or refused request."""
from __future__ import annotations

import time

from batchgen.engine.request import Sequence
from batchgen.engine.structured import StructuredDecoding, field_name
from batchgen.schema import KNOWN_FIELDS, error_result


class FinishRules:
    """Judges each new token of a sequence on the host, and decodes finished texts."""

    def __init__(self, tokenizer, structured: StructuredDecoding):
        self.tokenizer = tokenizer
        self.structured = structured

    def ends(self, seq: Sequence, token: int) -> bool:
        """seq has just taken `token`: whether that ended it (finish_reason set, or seq.error)."""
        return (seq.matcher is not None and self._grammar_ends(seq, token)) or self._limits_end(seq, token)

    def _grammar_ends(self, seq: Sequence, token: int) -> bool:
        """Its grammar accepts the new token (exactly once) -> whether that ended the sequence: a
        stop token where the grammar is complete (finish_reason stop, even under ignore_eos)."""
        if not self.structured.accept(seq, token):  # the mask allowed it: only a bug gets here
            seq.error = f"{field_name(seq.structured)}: generated token {token} was rejected by the grammar"
            return True
        if seq.matcher.is_terminated():
            seq.finish_reason, seq.text_tokens = "stop", len(seq.output_ids) - 1  # without the stop token
            return True
        return False

    def end_by_grammar(self, seq: Sequence) -> None:
        """A sequence that the grammar masks ended: its grammar failed to compile (seq.error), or is
        complete and allows only a stop token next (finish_reason stop, without sampling it)."""
        now = time.monotonic()
        if seq.error is None:
            seq.finish_reason, seq.text_tokens = "stop", len(seq.output_ids)
        seq.first_token = seq.first_token or now
        seq.finished_at = now

    def _limits_end(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        num_out = len(seq.token_ids) - seq.num_prompt  # known on the host (pending ones not counted)
        if token in seq.stop_ids and num_out >= params.min_tokens:
            # the text leaves out the stop token unless asked to keep it
            seq.finish_reason, seq.text_tokens = "stop", num_out - (not params.include_stop_str_in_output)
            return True
        if params.stop and num_out >= params.min_tokens and (
            num_out == params.min_tokens or self._stop_in_tail(seq)
        ):  # the whole text only when it may hold a stop string: it is decoded once, not every step
            text = self.decode(seq.output_ids, params.skip_special_tokens)
            cut, stop = min(((i, s) for s in params.stop if (i := text.find(s)) >= 0), default=(-1, ""))
            if cut >= 0:  # (the earliest stop string; of those found at one place, the first given)
                seq.finish_reason = "stop"
                seq.text = text[: cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
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
        tail = self.decode(seq.token_ids[max(seq.num_prompt, len(seq.token_ids) - window) :],
                           seq.params.skip_special_tokens)
        return any(s in tail for s in seq.params.stop)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_texts(self, seqs: list[Sequence]) -> list[Sequence]:
        """Fill in the text of finished sequences that have none yet (those that ended by a stop string
        have theirs), in one batched call; any thread may run it. -> seqs"""
        for skip in (True, False):  # (one batched call for each way of decoding)
            todo = [seq for seq in seqs if seq.text is None and seq.params.skip_special_tokens is skip]
            if todo:
                ids = [seq.token_ids[seq.num_prompt : seq.num_prompt + seq.text_tokens] for seq in todo]
                for seq, text in zip(todo, self.tokenizer.batch_decode(ids, skip_special_tokens=skip)):
                    seq.text = text
        return seqs


def result_row(seq: Sequence) -> dict:
    """The output row (README's Output) of a finished sequence."""
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
