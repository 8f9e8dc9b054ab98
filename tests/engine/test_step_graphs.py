"""The step graphs' padded batches, run eagerly on CPU (EagerGraphs: nothing captured): every step
goes through the static buffers the CUDA graphs read (padding tokens, padding sequences, padded
logits rows, the unified attention path; decode steps through their packed inputs, unpacked as a
decode graph unpacks them), and must give what the plain eager steps give."""
import pytest

from batchgen import LLM, SamplingParams
from batchgen.executor.cuda_graphs import ModelGraphs, batch_size_ladder, token_count_ladder


class EagerGraphs(ModelGraphs):
    """The graphs' static batches and padding without capturing: each replay runs its batch eagerly."""

    def _capture(self) -> None:
        pass


def test_ladders_cover_every_size():
    assert token_count_ladder(8192)[:3] == [64, 128, 192] and token_count_ladder(8192)[-1] == 8192
    assert token_count_ladder(100) == [64, 100]
    for n in (1, 63, 64, 65, 511, 513, 2049, 8191):
        assert any(s >= n for s in token_count_ladder(8192))
    assert batch_size_ladder(256)[:5] == [1, 2, 4, 8, 16] and batch_size_ladder(256)[-1] == 256
    assert batch_size_ladder(5) == [1, 2, 4, 5]
    assert batch_size_ladder(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    # every 8 rows from 128 (compute-bound products pay for padded rows), every 16 below
    ladder = batch_size_ladder(256)
    assert ladder[ladder.index(112):ladder.index(144) + 1] == [112, 128, 136, 144]
    assert all(b - a == 8 for a, b in zip(ladder[ladder.index(128):], ladder[ladder.index(128) + 1:]))
    assert batch_size_ladder(130)[-3:] == [112, 128, 130]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_padded_static_batches_match_eager_steps(tiny_model, kind):
    options = dict(device="cpu", dtype="float32", max_num_seqs=6, max_num_batched_tokens=80)
    requests = [
        {"id": i, "prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(5 + 23 * i)], "logprobs": True}
        for i in range(9)  # prompts of 5..189 tokens: chunks, mixed steps, more rows than max_num_seqs
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eager = LLM(str(tiny_model(kind)), **options)
    want = eager.generate_list(requests, params)
    padded = LLM(str(tiny_model(kind)), **options)
    runner = padded.engine.runner
    runner.use_graphs(EagerGraphs(runner.model, runner.kv, 6, runner.max_num_batched_tokens, runner.device))
    used = []
    pick, decode_key = runner.graphs.pick, runner.graphs.decode_key
    runner.graphs.pick = lambda fb, n: used.append(pick(fb, n)) or used[-1]
    runner.graphs.decode_key = lambda n: used.append(decode_key(n)) or used[-1]  # (packed inputs, unpacked)
    got = padded.generate_list(requests, params)
    kinds = {key[0] for key in used if key is not None}
    assert kinds == {"step", "decode"}  # both ladders served steps
    for a, b in zip(got, want):
        assert a["output_token_ids"] == b["output_token_ids"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def test_decode_graph_step_writes_cached_prefixes(tiny_model):
    """A decode-only step that also attaches cached prompt slots (StepInputs' prefix arrays): its
    decode graph step writes them into the token table beside the decode's own slot."""
    import torch

    from batchgen.executor.step_inputs import FIELDS, StepInputs

    llm = LLM(str(tiny_model("llama")), device="cpu", dtype="float32", max_num_seqs=4)
    runner = llm.engine.runner
    runner.use_graphs(EagerGraphs(runner.model, runner.kv, 4, runner.max_num_batched_tokens, runner.device))
    runner.kv.k.zero_(), runner.kv.v.zero_()  # (the cached slots' K/V: the pool is uninitialised memory)
    arrays = {f: [] for f in FIELDS}
    arrays.update(input_ids=[9], positions=[5], out_slots=[77], logits_indices=[0], prefix_rows=[2, 2],
                  prefix_positions=[3, 4], prefix_slots=[50, 51], token_rows=[2], rows=[2], kv_lens=[6], cu_q=[0, 1])
    inputs = StepInputs.pack([1, 1, 6, 0, 0], [arrays[f] for f in FIELDS])
    assert inputs.decode_only and inputs.has_prefix_writes
    with torch.inference_mode():
        logits = runner.run_step(inputs, None)
    assert runner.kv.req_to_token[2, 3:6].tolist() == [50, 51, 77]
    assert logits.shape[0] == 1 and torch.isfinite(logits).all()
