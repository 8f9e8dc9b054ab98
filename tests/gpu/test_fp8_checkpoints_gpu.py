"""On a GPU: the tiny FP8 checkpoints of each published form (tests/fp8_checkpoints.py) and --quantization fp8
keep their fp8 weights and scales on the device, and each FP8 layer's product (kernels/fp8_gemm.fp8_linear)
equals the CPU path's rounding (layers/fp8.py: activations rounded to e4m3 with the same scales, in fp32)
up to bf16 output rounding, at 1 to 300 rows; a job runs through the CUDA graphs (no one-row MLP) and its
prompt log-probabilities stay near the float32 HF reference with the same quantization; so do a model whose
o and down split K in parts, and a mixture of experts' FP8 checkpoints."""
import random

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM, SamplingParams
from batchgen.kernels import rmsnorm
from batchgen.kernels.e4m3 import dequantize_weight_ref
from batchgen.kernels.fp8_gemm import tma_tile
from batchgen.kernels.tile_gemm import tile_gemm_supported
from batchgen.layers.fp8 import E4M3, round_activations
from tests.fp8_checkpoints import (
    FORMS,
    MOE_FORMS,
    build_base,
    checkpoint_maker,
    moe_reference_model,
    reference_model,
    write_moe,
)
from tests.tiny_models import VOCAB, build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS = [1, 7, 64, 300]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_maker(tmp_path_factory.mktemp("fp8"))


def model_dir_and_options(form, checkpoints):
    if form == "quantize-at-load":
        return checkpoints("base"), {"quantization": "fp8"}
    return checkpoints(form), {}


def fp8_layers(model):
    return [m for m in model.modules() if getattr(m, "fp8", None) is not None]


@pytest.mark.parametrize("form", [*FORMS, "quantize-at-load"])
def test_fp8_products_on_cuda_round_as_the_cpu_path(form, checkpoints):
    model_dir, options = model_dir_and_options(form, checkpoints)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with LLM(str(model_dir), dtype="bfloat16", device="cuda", **options) as llm:
        model = llm.engine.runner.model
        assert all(layer.one_row_mlp is None for layer in model.layers)
        layers = fp8_layers(model)
        assert len(layers) == (7 if form == "ignore" else 8)  # 2 layers x (qkv, o, gate_up, down), one ignored
        for layer in layers:
            assert layer.weight.dtype == E4M3 and layer.weight_scale.dtype == torch.float32
            form_ = layer.fp8
            for rows in ROWS:
                x = torch.randn(rows, layer.weight.shape[1], device="cuda", generator=gen).to(torch.bfloat16)
                got = layer.matmul(x, layer.bias)
                rounded = round_activations(x.float(), form_.activations, layer.input_scale, form_.block)
                want = F.linear(rounded, dequantize_weight_ref(layer.weight, layer.weight_scale))
                torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def mean_prompt_logprob_error(model_dir, options, reference, tp: int = 1) -> float:
    """Mean |prompt log-probability - the reference model's| over four prompts run as one job."""
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (40, 64, 23, 200)]
    with LLM(str(model_dir), dtype="bfloat16", device="cuda", tensor_parallel_size=tp, **options) as llm:
        rows = [{"prompt_token_ids": p, "prompt_logprobs": True} for p in prompts]
        results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=16))
    assert all(r["finish_reason"] in ("length", "stop") for r in results)
    errors = []
    for p, r in zip(prompts, results):
        ids = torch.tensor([p])
        with torch.no_grad():
            want = reference(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        errors.append((torch.tensor(r["prompt_logprobs"]) - want).abs())
    return float(torch.cat(errors).mean())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("form", ["channel-dynamic", "tensor-static", "block", "quantize-at-load"])
def test_fp8_job_stays_near_the_float32_reference(form, tp, checkpoints):
    if tp > torch.cuda.device_count():
        pytest.skip("needs 2 GPUs")
    if form == "block" and tp == 2:
        pytest.skip("the tiny model's q shard under TP=2 cuts its 128-row blocks (refused)")
    model_dir, options = model_dir_and_options(form, checkpoints)
    reference = reference_model(checkpoints("base"), None if form == "quantize-at-load" else checkpoints(form),
                                "channel-dynamic" if form == "quantize-at-load" else form)
    mean = mean_prompt_logprob_error(model_dir, options, reference, tp)
    print(f"{form} tp={tp}: mean |prompt logprob - fp32 reference| = {mean:.4f}")
    assert mean < 0.03  # bf16 activations: ~0.01 on CPU; unscaled or misplaced weights: units


@pytest.mark.skipif(not torch.cuda.is_available() or not tile_gemm_supported(torch.device("cuda")),
                    reason="the TMA kernel's fp8 form: Hopper")
def test_split_fp8_products_reach_the_norm_as_parts(tmp_path, monkeypatch):
    """A model wide enough for the TMA kernel's split o and down (hidden 512, MLP 1,024), --quantization fp8:
    their fp32 parts go to the add + RMSNorm that sums them and rounds its output, and the job's prompt
    log-probabilities stay near the fp32 reference with the same quantization."""
    assert tma_tile(4, 512, 512, True, 132)[5] > 1 and tma_tile(4, 512, 1024, True, 132)[5] > 1
    base = build_base(tmp_path / "wide", hidden=512, intermediate=1024, heads=8, head_dim=64)
    with_parts = []

    rounding_norm = rmsnorm.add_rmsnorm_fp8_triton

    def spy(x, residual, weight, eps, parts=None):  # (every caller's path: the norm's launch)
        with_parts.append(parts is not None)
        return rounding_norm(x, residual, weight, eps, parts)

    monkeypatch.setattr(rmsnorm, "add_rmsnorm_fp8_triton", spy)
    mean = mean_prompt_logprob_error(base, {"quantization": "fp8"}, reference_model(base))
    assert any(with_parts)  # (the decode steps' o and down)
    assert mean < 0.03


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("form", [*MOE_FORMS, "quantize-at-load"])
def test_fp8_moe_checkpoint_stays_near_its_reference(form, tp, tmp_path):
    """A mixture of experts' FP8 checkpoint on the GPU (or --quantization fp8 on its bf16 one, against the
    per-channel checkpoint's numbers): fp8 attention, dense products and experts (the fused MoE's fp8 form);
    prompt log-probabilities near HF's fp32 model of the same weights with the same inputs rounded. Also
    under TP=2 (the MoE blocks' sums then reach the norms as the fp8 products' do)."""
    if tp > torch.cuda.device_count():
        pytest.skip("needs 2 GPUs")
    if tp == 2 and "block" in form:
        pytest.skip("the tiny model's expert shard under TP=2 cuts its 128-blocks (refused)")
    base = build("qwen3-moe-blocks", tmp_path / "base")
    written = "channel-dynamic" if form == "quantize-at-load" else form
    path = write_moe(written, base, tmp_path / written, tmp_path / "dequantized")
    options = {"quantization": "fp8"} if form == "quantize-at-load" else {}
    mean = mean_prompt_logprob_error(base if options else path, options,
                                     moe_reference_model(tmp_path / "dequantized", written), tp)
    print(f"moe {form} tp={tp}: mean |prompt logprob - fp32 reference| = {mean:.4f}")
    assert mean < 0.03
