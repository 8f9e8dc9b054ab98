"""A decoder layer's MLP at one row on a GPU in one launch (kernels/decode_mlp.py, or for H = 2,048
kernels/decode_mlp_gluon.py's where its start-up check passed): a decode of one sequence.

Each layer keeps a transposed copy of its down weight (W_down^T [I, H], 2 * I * H bytes) and an fp32
sum [1, H] its kernel adds into; the next layer's norm takes that sum as one split-K part
(layers/linear.SplitParts). Each layer's kernel zeroes the next layer's sum (the last's: the first's),
so a step must run all layers; a forward that raised part-way leaves the first sum for the next to zero.
Taken on one GPU, for 16-bit weights without bias, a gate/up of at most MAX_GATE_UP elements, and one
the skinny kernel would not read through TMA.
"""
from __future__ import annotations

import weakref

import torch

from batchgen.kernels import decode_mlp_gluon
from batchgen.kernels.decode_mlp import decode_mlp, supports
from batchgen.kernels.skinny_gemm import uses_tma
from batchgen.layers.linear import SplitParts

# The largest gate/up weight (elements) taken: llama-3.2-1b's gained, llama-3.1-8b's (3.5x larger) lost
MAX_GATE_UP = 1 << 25


class OneRowMLP:
    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        self.w_gate_up = w_gate_up
        self.w_down_t = w_down.t().contiguous()
        self.sum = torch.zeros(1, w_down.shape[0], dtype=torch.float32, device=w_down.device)
        self.parts = SplitParts(self.sum.view(1, 1, -1))  # what the layer hands on: the sum, as one part
        self.next = self.first = self  # the next layer's and the first layer's (linked_one_row_mlps)
        self.open = False  # (the first layer's) a forward's MLPs began and have not all run yet

    # The ring's links are weak (the model's layers hold every OneRowMLP): a ring of strong ones is a
    # reference cycle that would keep the weights' copies on the GPU after the model is dropped.
    @property
    def next(self) -> OneRowMLP:
        return self._next()

    @next.setter
    def next(self, mlp: OneRowMLP) -> None:
        self._next = weakref.ref(mlp)

    @property
    def first(self) -> OneRowMLP:
        return self._first()

    @first.setter
    def first(self, mlp: OneRowMLP) -> None:
        self._first = weakref.ref(mlp)

    @staticmethod
    def takes(x, residual: torch.Tensor | None) -> bool:
        """Whether the MLP after an attention block of output x runs here: one row of a plain tensor."""
        return isinstance(x, torch.Tensor) and residual is not None and x.shape[0] == 1

    def __call__(self, norm, x: torch.Tensor, residual: torch.Tensor) -> tuple[SplitParts, torch.Tensor]:
        """(the MLP of norm(x + residual), as one fp32 part, x + residual); norm: the layer's RMSNorm."""
        first, following = self._first(), self._next()
        if first is self:
            if self.open:  # the last forward raised part-way (an eager step): the last layer never zeroed this
                self.sum.zero_()
            self.open = True
        # the persistent Gluon kernel where its check passed (H = 2,048), else the Triton one
        gluon = decode_mlp_gluon.usable(x.device, residual.dtype, self.w_down_t.shape[1])
        mlp = decode_mlp_gluon.decode_mlp_gluon if gluon else decode_mlp
        new_residual = mlp(x, residual, norm.weight, norm.eps, self.w_gate_up, self.w_down_t, self.sum, following.sum)
        if following is first:
            first.open = False
        return self.parts, new_residual


def one_row_mlps(mlps: list, device: torch.device, tp_size: int) -> list[OneRowMLP] | None:
    """linked_one_row_mlps(mlps) where the engine takes them, else None (see the module's docstring)."""
    if device.type != "cuda" or tp_size != 1 or len(mlps) < 2:
        return None
    gate_up, down = mlps[0].gate_up_proj, mlps[0].down_proj
    hidden = down.weight.shape[0]
    if gate_up.bias is not None or down.bias is not None or not supports(hidden):
        return None
    if any(mlp.gate_up_proj.fp8 is not None or mlp.down_proj.fp8 is not None for mlp in mlps):
        return None  # (FP8 layers have their own products: layers/fp8.py)
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
