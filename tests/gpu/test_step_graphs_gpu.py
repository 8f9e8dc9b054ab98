"""On a GPU: a mixed step (decodes and prefill chunks, one with a cached part) replayed from a step
graph gives the logits of the same step run eagerly, through the same unified attention kernel
(equal up to fp32 reassociation) and through the eager split decode/prefill kernels (close)."""
import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.step_plan import plan_step


def add_rows(engine, rows, params):
    for prepared in engine.request_preparer(params)(rows):
        engine.add(*engine.sequences(prepared))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_mixed_step_graph_equals_eager(tiny_model, kind):
    llm = LLM(str(tiny_model(kind)), dtype="float32", max_num_seqs=8, max_num_batched_tokens=96)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # three sequences that will be decoding
    add_rows(engine, [{"id": i, "prompt_token_ids": [5 + i, 17, 99, 3] * (2 + i)} for i in range(3)], params)
    for _ in range(4):
        engine.step()
    # two long prompts: chunks, one continuing a cached part
    add_rows(engine, [{"id": i, "prompt_token_ids": list(range(10 + i, 150 + i))} for i in range(3, 5)], params)
    checked = 0
    for _ in range(4):
        batch = engine.scheduler.schedule()
        inputs, samplers, _ = plan_step(batch, runner.tp.size)
        previous = engine.in_flight.tokens if engine.in_flight is not None else None
        with torch.inference_mode():
            fb = runner.forward_batch(inputs, previous)
            fb.record_slots()
            key = runner.graphs.pick(fb, inputs.num_logits)
            if fb.num_prefill and fb.num_decode:
                assert key is not None and key[0] == "step"
                graphed = runner.model.compute_logits(runner.graphs.run(fb, key)).clone()
                fb.unified = True
                eager_unified = runner.forward(fb)
                fb.unified = False
                eager_split = runner.forward(fb)
                torch.testing.assert_close(graphed, eager_unified, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(graphed, eager_split, rtol=1e-3, atol=1e-3)
                checked += 1
        # then the step as engine.step() runs it, so that the engine's state moves on
        launched = engine._sample(runner.launch_forward(inputs, previous), samplers, [])
        if engine.in_flight is not None:
            engine._read_back(engine.in_flight)
        engine.in_flight = launched
    assert checked >= 2
    llm.close()
