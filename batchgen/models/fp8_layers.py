"""Make a built model's quantized linear layers FP8 before its weights load (layers/fp8.py), following
the scheme models/quantization.py read from the checkpoint or --quantization fp8."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from batchgen.layers.fp8 import Fp8Form, finish_fp8, make_fp8
from batchgen.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear
from batchgen.layers.moe import FusedExperts
from batchgen.layers.packed_linear import PackableWeight
from batchgen.models.errors import UnsupportedModelError
from batchgen.models.quantization import BLOCK, Fp8Scheme


def layer_form(scheme: Fp8Scheme) -> Fp8Form:
    """The layers' form: per-tensor weight scales are expanded to rows at load, so those are "channel"."""
    weights = "block" if scheme.weights == "block" else "channel"
    return Fp8Form(weights, scheme.activations, BLOCK, scheme.quantize_at_load)


def _check_blocks(layer, name: str) -> None:
    """128x128 blocks: each rank's slice of each shard must start on a block boundary (the grid is cut
    along with the weight), which holds where every shard but the layer's last spans whole blocks."""
    if isinstance(layer, ColumnParallelLinear):
        if isinstance(layer, QKVParallelLinear):
            sizes = [layer.q_size, layer.kv_size, layer.kv_size]
        elif isinstance(layer, MergedColumnParallelLinear):
            sizes = [s // layer.tp.size for s in layer.out_sizes]
        else:
            sizes = [layer.out_per_rank]
        aligned = all(s % BLOCK == 0 for s in (sizes if layer.tp.size > 1 else sizes[:-1]))
    else:
        aligned = layer.tp.size == 1 or layer.in_per_rank % BLOCK == 0
    if not aligned:
        raise UnsupportedModelError(
            f"{name}: 128x128 FP8 blocks need each merged shard and each tensor-parallel slice of it to span "
            f"whole blocks of 128 rows; its sizes do not (try another --tensor-parallel-size)"
        )


def _check_expert_blocks(experts: FusedExperts, name: str) -> None:
    """128x128 blocks under TP: each rank's slice of an expert's intermediate features is whole blocks."""
    if experts.inter_shards > 1 and experts.inter % BLOCK:
        raise UnsupportedModelError(
            f"{name}: 128x128 FP8 blocks need each tensor-parallel slice of the experts' "
            f"{experts.inter * experts.inter_shards} intermediate features to span whole blocks of 128; "
            f"{experts.inter} do not (try another --tensor-parallel-size, or --expert-parallel)"
        )


def apply_scheme(model, scheme: Fp8Scheme, packed_modules_mapping: dict) -> list[Callable[[torch.dtype], None]]:
    """Make each quantized linear layer of the decoder FP8 (layers/fp8.make_fp8), before loading; the
    LM head and embeddings stay as they are. -> each FP8 layer's step after loading, called with the
    model's dtype (layers/fp8.finish_fp8, or the experts' FusedExperts.finish_fp8). A merged layer (q/k/v, gate/up) must
    have all of its checkpoint modules quantized or none. An MoE layer's quantized experts keep their
    e4m3 weights and scales (layers/moe.FusedExperts.accept_fp8); --quantization fp8 leaves its routers
    (and a shared expert's gate) in the model's dtype, as vLLM does."""
    form = layer_form(scheme)
    checkpoint_module = getattr(model, "checkpoint_module", lambda name: name)
    finishes = []
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts) and scheme.quantizes(f"model.{checkpoint_module(name)}.0.gate_proj"):
            if scheme.weights == "block":
                _check_expert_blocks(module, f"model.{name}")
            module.accept_fp8(scheme.weights == "block", scheme.quantize_at_load)
            finishes.append(module.finish_fp8)
        if not isinstance(module, PackableWeight) or module is model.lm_head:
            continue
        if scheme.quantize_at_load and getattr(module, "routes_tokens", False):
            continue
        parent, ours = name.rsplit(".", 1)
        theirs = [t for t, (o, _) in packed_modules_mapping.items() if o == ours] or [ours]
        quantized = {scheme.quantizes(f"model.{checkpoint_module(parent)}.{t}") for t in theirs}
        if len(quantized) > 1:
            raise UnsupportedModelError(f"model.{parent}: the config quantizes some of {', '.join(theirs)} "
                                        f"but not all, which batchgen holds as one matrix")
        if quantized.pop():
            if scheme.weights == "block":
                _check_blocks(module, f"model.{name}")
            make_fp8(module, form)
            finishes.append(functools.partial(finish_fp8, module))
    return finishes
