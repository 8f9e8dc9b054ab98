"""The step graphs' padded batches, run eagerly on CPU (ModelGraphs(capture=False)): every step
goes through the static buffers the CUDA graphs read (padding tokens, padding sequences, padded
logits rows, the unified attention path; decode steps through their packed inputs, unpacked as a
decode graph unpacks them), and must give what the plain eager steps give."""
import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine.cuda_graphs import ModelGraphs, batch_size_ladder, token_count_ladder


def test_ladders_cover_every_size():
    assert token_count_ladder(8192)[:3] == [64, 128, 192] and token_count_ladder(8192)[-1] == 8192
    assert token_count_ladder(100) == [64, 100]
    for n in (1, 63, 64, 65, 511, 513, 2049, 8191):
        assert any(s >= n for s in token_count_ladder(8192))
    assert batch_size_ladder(256)[:5] == [1, 2, 4, 8, 16] and batch_size_ladder(256)[-1] == 256
    assert batch_size_ladder(5) == [1, 2, 4, 5]


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
    runner.graphs = ModelGraphs(runner.model, runner.kv, 6, runner.max_num_batched_tokens, runner.device,
                                capture=False)
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
