"""Every layer's product (PackableWeight.matmul), and on CPU the weight packed once for oneDNN.

On CPU F.linear hands oneDNN the plain [out, in] weight, which it re-lays out on every call; packing
once after loading (torch's mkldnn._reorder_linear_weight / _linear_pointwise, where a probe gives
F.linear's result) makes the products faster, bit for bit in bf16. On a GPU: one row of 16-bit
activations streams its weight through the skinny kernel (kernels/skinny_gemm.py) where the weight has
at most SKINNY_MAX_WEIGHT elements or TMA reads it; on Hopper 2 to 64 rows of gate/up (with its
SiLU-and-mul) and of o and down (split-K parts the next add + RMSNorm sums) take the tile kernel where
kernels/tile_gemm.tile_for says so; everything else is F.linear.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from batchgen.kernels import decode_mlp_gluon
from batchgen.kernels.invariant_gemm import invariant_gemm, split_of
from batchgen.kernels.silu_and_mul import silu_and_mul
from batchgen.kernels.skinny_gemm import skinny_gemm, uses_tma
from batchgen.kernels.tile_gemm import tile_for, tile_gemm


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ packed^T (+ bias) -> [T, out]; packed: from pack_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def can_pack(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU pack weights of dtype and then compute what F.linear computes."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(5, 40, generator=gen).to(dtype)
    try:
        got = packed_linear(x, _pack(weight), bias)
    except (RuntimeError, NotImplementedError):  # e.g. fp16 on a CPU without avx512_fp16
        return False
    want = F.linear(x, weight, bias)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


# Layer weights up to this size go to the skinny kernel at one row (cuBLAS is as fast on larger ones,
# with or without the norm in the product); LM heads, far larger, stream faster again (ParallelLMHead
# asks streams_weight alone), and so do weights read through TMA (skinny_gemm.uses_tma), at any size.
SKINNY_MAX_WEIGHT = 1 << 24


def streams_weight(x: torch.Tensor) -> bool:
    """Whether a product with x [T, in] goes to the skinny kernel: one row, 16-bit, on a GPU."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)


def stream_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
    out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """skinny_gemm's product; on a GPU, one row whose weight fits the Gluon ring whole (llama-3.2-1b's o:
    decode_mlp_gluon.row_product_takes) through that ring instead."""
    if x.is_cuda and bias is None and not silu_mul and decode_mlp_gluon.row_product_takes(x, weight):
        return decode_mlp_gluon.row_product_gluon(x, weight, out_dtype, out)
    return skinny_gemm(x, weight, bias, silu_mul, out_dtype, out)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a CPU weight [out, in], or None where packing is not available."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not can_pack(weight.dtype):
        return None
    return _pack(weight.detach())


class PackableWeight:
    """For layers whose forward is a product with self.weight [out, in]: `pack()` (CPU, after
    loading) switches that product to the packed copy and frees the plain weight unless another
    module shares it (a tied LM head's is the embedding's)."""

    packed: torch.Tensor | None = None
    fp8 = None  # an FP8 layer's layers.fp8.Fp8Form: its own product, never the 16-bit kernels'
    batch_invariant = False  # GPU products through kernels/invariant_gemm.py (EngineConfig.batch_invariant)

    def pack(self, keep_plain: bool = False) -> None:
        self.packed = pack_weight(self.weight)
        if self.packed is not None and not keep_plain:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # only the packed copy is read now

    def streams(self, x: torch.Tensor) -> bool:
        """Whether the product with x goes to the skinny kernel."""
        # (packed weights are CPU's; FP8 layers have their own product)
        return (self.fp8 is None and not self.batch_invariant and streams_weight(x)
                and (self.weight.numel() <= SKINNY_MAX_WEIGHT or uses_tma(x, self.weight)))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
               out: torch.Tensor | None = None, silu_mul_out: bool = False, parts_ok: bool = False) -> torch.Tensor:
        """x [T, in] @ weight^T (+ bias); silu_mul: x is a gate/up pair [T, 2 in] and the product takes
        silu(gate) * up. silu_mul_out: the weight is an MLP's gate/up and the caller applies silu(gate) *
        up next: where the tile kernel takes the product it applies it and returns [T, out / 2], else the
        pair [T, out]. parts_ok: the caller sums split-K parts, which the tile kernel may return instead,
        fp32 [S, T, out]. out [T, out]: where the GPU's product (no bias) is written, unless it comes
        in parts; the CPU's packed product returns a new tensor."""
        if self.fp8 is not None:  # (the pair [T, out] for silu_mul_out, a new tensor)
            return self.fp8.product(self, x, bias, silu_mul, parts_ok)
        if self.batch_invariant and x.is_cuda:
            return self.invariant_product(x, bias, silu_mul, out, parts_ok, silu_mul_out)
        if self.streams(x):
            return stream_product(x, self.weight, bias, silu_mul, out=out if bias is None else None)
        if silu_mul:
            x = silu_and_mul(x)
        tile = tile_for(x, self.weight, silu_mul_out, parts_ok) if bias is None and self.packed is None else None
        if tile is not None:
            return tile_gemm(x, self.weight, silu_mul_out, parts_ok, tile, out)
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        if out is not None and bias is None and x.dim() == 2:
            return torch.mm(x, self.weight.t(), out=out)
        return F.linear(x, self.weight, bias)

    def invariant_product(self, x: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
                          out: torch.Tensor | None, parts_ok: bool, silu_mul_out: bool) -> torch.Tensor:
        """matmul in batch-invariant mode: every row count through the one kernel, K split (into parts the
        caller sums) by the weight's shape alone."""
        if silu_mul:
            x = silu_and_mul(x)
        split = split_of(*self.weight.shape) if parts_ok and bias is None else 1
        return invariant_gemm(x, self.weight, bias, split, out=out if split == 1 else None, silu_mul_out=silu_mul_out)
