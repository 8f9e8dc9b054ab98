"""A decoder layer's MLP at one row on a GPU in one launch (kernels/decode_mlp.py): the add + RMSNorm,
gate/up, SiLU-and-mul and down of a decode of one sequence, whose products are streams of weights.

The kernel reads the down projection's weight transposed, so each layer keeps a transposed copy of it
(W_down^T [I, H], made once at start-up: 2 * I * H bytes a layer, e.g. 537 MB for llama-3.2-1b), and
an fp32 sum [1, H] that the kernel's programs add into. The next layer's norm takes that sum as
split-K parts of one part (layers/linear.SplitParts: the skinny qkv product reads it as it norms, the
final norm sums it). Each layer's kernel zeroes the next layer's sum (the last layer's: the first's),
which is why every step must run all layers, as every forward does; one that raised part-way (an
eager step) left the first layer's sum unzeroed, and the next forward zeroes it first. A graph's
replay always runs all of its kernels.

Taken where it pays (H200, KERNELS.md session 19): one GPU (a row-parallel down projection would
need its all-reduce), 16-bit weights, no MLP bias, a gate/up of at most MAX_GATE_UP elements, and
one that the skinny kernel would not read through TMA (qwen2.5-0.5b's, H <= 1024, which is faster
that way). For llama-3.2-1b's H the kernel is
kernels/decode_mlp_gluon.py's where its start-up check passes.
"""
from __future__ import annotations

import torch

from batchgen.kernels import decode_mlp_gluon
from batchgen.kernels.decode_mlp import decode_mlp, supports
from batchgen.kernels.skinny_gemm import uses_tma
from batchgen.layers.linear import SplitParts

# The largest gate/up weight (elements) taken: llama-3.2-1b's (2^25) gained, W-decode1 0.912 against
# 0.951 ms a token; llama-3.1-8b's (3.5x larger) lost, 4.80 against 4.54 (H200, KERNELS.md session 19).
MAX_GATE_UP = 1 << 25


class OneRowMLP:
    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        self.w_gate_up = w_gate_up
        self.w_down_t = w_down.t().contiguous()
        self.sum = torch.zeros(1, w_down.shape[0], dtype=torch.float32, device=w_down.device)
        self.parts = SplitParts(self.sum.view(1, 1, -1))  # what the layer hands on: the sum, as one part
        self.next = self.first = self  # the next layer's and the first layer's (linked_one_row_mlps)
        self.open = False  # (the first layer's) a forward's MLPs began and have not all run yet

    @staticmethod
    def takes(x, residual: torch.Tensor | None) -> bool:
        """Whether the MLP after an attention block of output x runs here: one row of a plain tensor."""
        return isinstance(x, torch.Tensor) and residual is not None and x.shape[0] == 1

    def __call__(self, norm, x: torch.Tensor, residual: torch.Tensor) -> tuple[SplitParts, torch.Tensor]:
        """(the MLP of norm(x + residual), as one fp32 part, x + residual); norm: the layer's RMSNorm."""
        if self.first is self:
            if self.open:  # the last forward raised part-way (an eager step): the last layer never zeroed this
                self.sum.zero_()
            self.open = True
        # the persistent Gluon kernel where its check passed (H = 2,048), else the Triton one
        gluon = decode_mlp_gluon.usable(x.device, residual.dtype, self.w_down_t.shape[1])
        mlp = decode_mlp_gluon.decode_mlp_gluon if gluon else decode_mlp
        new_residual = mlp(x, residual, norm.weight, norm.eps, self.w_gate_up, self.w_down_t, self.sum, self.next.sum)
        if self.next is self.first:
            self.first.open = False
        return self.parts, new_residual


def one_row_mlps(mlps: list, device: torch.device, tp_size: int) -> list[OneRowMLP] | None:
    """linked_one_row_mlps(mlps) where the engine takes them, else None (see the module's docstring)."""
    if device.type != "cuda" or tp_size != 1 or len(mlps) < 2:
        return None
    gate_up, down = mlps[0].gate_up_proj, mlps[0].down_proj
    hidden = down.weight.shape[0]
    if gate_up.bias is not None or down.bias is not None or not supports(hidden):
        return None
    if down.weight.dtype not in (torch.float16, torch.bfloat16) or gate_up.weight.numel() > MAX_GATE_UP:
        return None
    if uses_tma(torch.empty(1, hidden, dtype=down.weight.dtype, device=device), gate_up.weight):
        return None
    decode_mlp_gluon.check(device, down.weight.dtype, hidden)  # (the persistent kernel where it compiles and agrees)
    return linked_one_row_mlps(mlps)


def linked_one_row_mlps(mlps: list) -> list[OneRowMLP]:
    """One OneRowMLP a layer (mlps: the layers' MLPs, each with gate_up_proj and down_proj), each
    linked to the next, the last to the first (at least two layers: a layer's sum is not the next's)."""
    assert len(mlps) >= 2
    layers = [OneRowMLP(mlp.gate_up_proj.weight, mlp.down_proj.weight) for mlp in mlps]
    for layer, following in zip(layers, layers[1:] + layers[:1]):
        layer.next, layer.first = following, layers[0]
    return layers
