"""FP8 on CPU: tiny checkpoints in each published FP8 form (tests/fp8_checkpoints.py) and `--quantization fp8`
give the greedy tokens of HF transformers' float32 model with the same quantization applied (dequantized
weights, each quantized Linear's input rounded to e4m3 with the scheme's scales), alone, in a batch and
under TP=2; the KV-cache scales reach the attention layers; quantization configs batchgen does not
implement, and FP8 weights whose scales it would not apply, are refused before a job starts. A difference
in tokens is tolerated only after a step where the reference's top-2 logits were within TIE: a last-bit
difference in an fp32 activation (another CPU's summation order) can move its e4m3 rounding by one step,
1/16 of the value, which can move these tiny models' logits by a few 1e-3."""
import json
import random

import pytest

from batchgen import LLM, SamplingParams
from batchgen.models.model_config import UnsupportedModelError
from tests.fp8_checkpoints import (
    FORMS,
    IGNORED_DOWN,
    checkpoint_maker,
    greedy_reference,
    reference_model,
    with_quantization_config,
)
from tests.test_cli_run import read as read_output
from tests.tiny_models import EOS, VOCAB

LENGTHS = [1, 5, 40, 17]
TIE = 1e-2
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def prompts():
    rng = random.Random(3)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_maker(tmp_path_factory.mktemp("fp8"))


def reference(checkpoints, form: str, quantized: bool = True):
    model = reference_model(checkpoints("base"), checkpoints(form) if quantized else None, form)
    return [greedy_reference(model, p, MAX_TOKENS) for p in prompts()]


def assert_tokens_match(results, refs):
    for result, (ref_tokens, margins) in zip(results, refs):
        ours = result["output_token_ids"]
        diverged = next((i for i, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b), None)
        if diverged is None:
            assert ours == ref_tokens and result["finish_reason"] == ("stop" if ours[-1] == EOS else "length")
        else:
            assert min(margins[: diverged + 1]) < TIE, f"token {diverged}: ours {ours} vs reference {ref_tokens}"


def generate(model_dir, **options):
    with LLM(str(model_dir), dtype="float32", device="cpu", **options) as llm:
        return llm.generate_list([{"prompt_token_ids": p} for p in prompts()], GREEDY)


@pytest.mark.parametrize("form", FORMS)
def test_published_form_gives_the_reference_tokens(form, checkpoints):
    refs = reference(checkpoints, form)
    assert_tokens_match(generate(checkpoints(form)), refs)
    # one at a time too (other batch shapes: the per-token and per-group scales are each row's own)
    for p, ref in zip(prompts()[:2], refs[:2]):
        with LLM(str(checkpoints(form)), dtype="float32", device="cpu") as llm:
            assert_tokens_match(llm.generate_list([{"prompt_token_ids": p}], GREEDY), [ref])


def test_quantization_fp8_gives_the_reference_tokens(checkpoints):
    """--quantization fp8 on the fp32 checkpoint: weights per output channel, activations per token."""
    results = generate(checkpoints("base"), quantization="fp8")
    assert_tokens_match(results, reference(checkpoints, "channel-dynamic", quantized=False))
    plain = [r["output_token_ids"] for r in generate(checkpoints("base"))]
    assert plain != [r["output_token_ids"] for r in results]  # (the quantization changes these tokens)


def test_tensor_parallel_2_gives_the_reference_tokens(checkpoints):
    """Per-tensor weight scales expanded per row and sharded with q/k/v and gate/up; static input scales."""
    results = generate(checkpoints("tensor-static"), tensor_parallel_size=2)
    assert_tokens_match(results, reference(checkpoints, "tensor-static"))


def test_kv_cache_scales_reach_the_attention_layers(checkpoints):
    with LLM(str(checkpoints("tensor-static")), dtype="float32", device="cpu") as llm:
        layers = llm.engine.runner.model.attention_layers()
        assert [a.k_scale for a in layers] == pytest.approx([0.02, 0.03])
        assert [a.v_scale for a in layers] == pytest.approx([0.03, 0.04])
    with LLM(str(checkpoints("channel-dynamic")), dtype="float32", device="cpu") as llm:
        assert {(a.k_scale, a.v_scale) for a in llm.engine.runner.model.attention_layers()} == {(1.0, 1.0)}


def test_ignored_layer_stays_unquantized(checkpoints):
    with LLM(str(checkpoints("ignore")), dtype="float32", device="cpu") as llm:
        model = llm.engine.runner.model
        assert model.layers[1].mlp.down_proj.fp8 is None and model.layers[0].mlp.down_proj.fp8 is not None
        assert model.lm_head.fp8 is None


def _edited(checkpoints, tmp_path, form: str, quant: dict | None):
    """The form's checkpoint with another quantization_config (None: none)."""
    return with_quantization_config(checkpoints(form), tmp_path / f"{form}-{len(list(tmp_path.iterdir()))}", quant)


def test_fp8_weights_never_run_unscaled(checkpoints, tmp_path):
    """FP8 tensors where the config quantizes nothing, or a layer its ignore list leaves alone: refused."""
    with pytest.raises(ValueError, match="is fp8 but"):
        LLM(str(_edited(checkpoints, tmp_path, "channel-dynamic", None)), dtype="float32", device="cpu")
    config = json.loads((checkpoints("channel-dynamic") / "config.json").read_text())["quantization_config"]
    config["ignore"] = ["lm_head", IGNORED_DOWN]
    with pytest.raises(ValueError, match="is fp8 but .* does not quantize that layer"):
        LLM(str(_edited(checkpoints, tmp_path, "channel-dynamic", config)), dtype="float32", device="cpu")


def test_block_form_refuses_a_split_that_cuts_its_blocks(checkpoints, tmp_path):
    """Under TP=2 each rank's q (2 heads of 32 rows) would start inside a 128-row block."""
    with pytest.raises(UnsupportedModelError, match="128x128 FP8 blocks"):
        LLM(str(checkpoints("block")), dtype="float32", device="cpu", tensor_parallel_size=2)


def _compressed_int8() -> dict:
    group = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": group,
                                          "input_activations": {**group, "strategy": "token", "dynamic": True}}}}


REFUSED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "'gptq'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     "'bitsandbytes'"),
    "int8": (_compressed_int8(), "compressed-tensors 'int-quantized'"),
    "fp8-block-64": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]},
                     "fp8 with weight_block_size [64, 64]"),
}


def _run_args(workdir, model_dir, *options):
    """`batchgen run` of one prompt in workdir (in.jsonl -> out.parquet)."""
    workdir.mkdir(exist_ok=True)
    src = workdir / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hello"}\n')
    return ("run", src, workdir / "out.parquet", "--model", model_dir, "--device", "cpu", "--dtype", "float32",
            "--max-tokens", "2", *options)


@pytest.mark.parametrize("name", REFUSED)
def test_unsupported_quantization_is_a_usage_error(name, batchgen, checkpoints, tmp_path):
    quant, names_it = REFUSED[name]
    model_dir = with_quantization_config(checkpoints("base"), tmp_path / name, quant)
    done = batchgen(*_run_args(tmp_path, model_dir))
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and f"quantization {names_it}" in line and "not supported; supported:" in line, line
    assert not (tmp_path / "out.parquet").exists()


def test_quantization_fp8_of_an_fp8_checkpoint_is_a_usage_error(batchgen, checkpoints, tmp_path):
    done = batchgen(*_run_args(tmp_path, checkpoints("block"), "--quantization", "fp8"))
    assert done.returncode == 2 and "already quantized" in done.stderr, done.stderr


def test_cli_runs_an_fp8_checkpoint_and_records_its_form(batchgen, checkpoints, tmp_path):
    done = batchgen(*_run_args(tmp_path, checkpoints("block")))
    assert done.returncode == 0, done.stderr
    rows, meta = read_output(tmp_path / "out.parquet")
    assert [r["completion_tokens"] for r in rows] == [2]
    assert meta["quantization"] == "fp8 checkpoint: weights 128x128 blocks, activations per group of 128"
    done = batchgen(*_run_args(tmp_path / "at-load", checkpoints("base"), "--quantization", "fp8"))
    assert done.returncode == 0, done.stderr
    assert read_output(tmp_path / "at-load" / "out.parquet")[1]["quantization"] == (
        "fp8 quantized at load: weights per channel, activations per token")
