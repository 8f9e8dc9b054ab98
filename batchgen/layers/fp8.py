"""FP8 (e4m3) linear layers: a layer's form, the rounding math in float32, and its product.

Weights are e4m3 with fp32 scales per output row (per-tensor checkpoints expanded to rows) or per
128x128 block; activations are rounded to e4m3 per token (scale = amax(row) / 448), with a static
per-tensor scale, or per group of 128 along K. On CUDA the layer keeps its fp8 weight and the product is
kernels/fp8_gemm.fp8_linear; on CPU the weight is dequantized into the compute dtype at load (so that
oneDNN packs it as any other) and each product rounds its input activations to e4m3 first, in fp32: the
rounding the GPU's kernel applies, so CPU runs test the numerics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.e4m3 import FP8 as E4M3
from batchgen.kernels.e4m3 import dequantize_weight_ref, quantize_weight_ref, round_ref
from batchgen.kernels.fp8_gemm import blockwise_scaled_mm_ok, fp8_linear, fp8_product
from batchgen.kernels.silu_and_mul import silu_and_mul
from batchgen.layers.packed_linear import packed_linear

WEIGHT_FORMS = ("channel", "block")
ACTIVATION_FORMS = ("token", "tensor-static", "group")


def round_activations(x: torch.Tensor, activations: str, input_scale: torch.Tensor | None,
                      block: int) -> torch.Tensor:
    """x [T, K] with each row rounded to e4m3 as the product's kernel rounds it: per token, with the static
    input_scale, or per group of `block` along K (the last group may be shorter); in x's dtype."""
    static = input_scale if activations == "tensor-static" else None
    return round_ref(x, static, block if activations == "group" else None).to(x.dtype)


@dataclass(frozen=True)
class Fp8Form:
    """How a layer's product is quantized. weights: "channel" (a scale per output row) or "block" (one per
    block x block); activations: "token" (dynamic), "tensor-static" (input_scale) or "group" (dynamic, per
    block along K). quantize_at_load: the checkpoint's weight is 16/32-bit and quantized per row after
    loading (--quantization fp8)."""
    weights: str
    activations: str
    block: int = 128
    quantize_at_load: bool = False

    def __post_init__(self):
        assert self.weights in WEIGHT_FORMS and self.activations in ACTIVATION_FORMS, self

    def product(self, layer, x: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
                parts_ok: bool = False) -> torch.Tensor:
        """layer's x [T, K] @ weight^T (+ bias) -> [T, N]; silu_mul: x is a gate/up pair [T, 2K]. parts_ok:
        the caller sums split-K parts, which a GPU's product of a 2-D x may return (fp32 [S, T, N])."""
        if x.is_cuda:  # (silu(gate) * up rounded in the same kernel)
            y = fp8_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale, layer.input_scale,
                           bias, x.dtype, silu_mul, parts_ok and x.dim() == 2)
            return y if y.dim() == 3 else y.view(*x.shape[:-1], -1)
        if silu_mul:
            x = silu_and_mul(x)
        x = round_activations(x, self.activations, layer.input_scale, self.block)
        if layer.packed is not None:
            return packed_linear(x, layer.packed, bias)
        return F.linear(x, layer.weight, bias)

    def takes_normed_rows(self, x: torch.Tensor) -> bool:
        """Whether the RMSNorm before this layer may hand it x's rows already rounded to e4m3
        (kernels/rmsnorm.add_rmsnorm_fp8, one launch for the norm and the rounding): on a GPU, for
        per-channel weights with per-token dynamic activations."""
        return x.is_cuda and self.weights == "channel" and self.activations == "token"

    def product_of_rounded(self, layer, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
                           out_dtype: torch.dtype) -> torch.Tensor:
        """product() of rows the norm rounded: q [T, K] e4m3 and their scales s [T, 1] (never parts: the
        products after a norm are qkv and gate/up)."""
        return fp8_product(q, s, layer.weight, layer.weight_scale, None, bias, out_dtype)


def _param(tensor: torch.Tensor, loader) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader
    return param


def load_input_scale(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
    """A static input scale (one per tensor). Merged shards (q/k/v, gate/up) share their input, so one
    scale serves them all: the largest of theirs, as vLLM takes (a larger scale only widens the grid)."""
    param.data.copy_(torch.maximum(param.data, loaded.float().reshape(())))


def make_fp8(layer, form: Fp8Form) -> None:
    """Turn a linear layer (layers/linear.py) into an FP8 one before loading: an e4m3 weight of the same
    shape, weight_scale fp32 [N] or its block grid, and input_scale for static activations; each
    parameter loads with the layer's loaders. quantize_at_load keeps the plain weight (finish_fp8
    quantizes it)."""
    layer.fp8 = form
    layer.input_scale = None
    if form.quantize_at_load:
        return
    n, k = layer.weight.shape
    device = layer.weight.device
    layer.weight = _param(torch.empty(n, k, dtype=E4M3, device=device), layer.weight_loader)
    grid = (n,) if form.weights == "channel" else (-(-n // form.block), -(-k // form.block))
    layer.weight_scale = _param(torch.zeros(grid, dtype=torch.float32, device=device), layer.weight_scale_loader)
    if form.activations == "tensor-static":
        layer.input_scale = _param(torch.zeros((), dtype=torch.float32, device=device), load_input_scale)


def finish_fp8(layer, dtype: torch.dtype) -> None:
    """After loading: quantize_at_load quantizes the weight per row; then on CPU the weight is dequantized
    into dtype (the compute dtype) and its scales dropped, on CUDA the fp8 weight and scales stay."""
    if layer.fp8.quantize_at_load:
        weight, scale = quantize_weight_ref(layer.weight.data)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    if layer.weight.device.type == "cuda":
        if layer.fp8.weights == "block":
            blockwise_scaled_mm_ok(layer.weight.device)  # (asked here, never inside a graph's capture)
        return
    plain = dequantize_weight_ref(layer.weight.data, layer.weight_scale.data).to(dtype)
    layer.weight = nn.Parameter(plain, requires_grad=False)
    del layer.weight_scale
