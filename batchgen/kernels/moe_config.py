"""The fused MoE's block sizes (kernels/fused_moe.py): BLOCK_M, the slots of one expert's block (the
align's padding unit, shared by both products), and each product's column tile, K step, warps and
pipeline stages. Timed tables per GPU model and layer shape where benchmarks/fused_moe.py --tune has
made one (`TUNED`, `TUNED_FP8`), else `default_config`'s rule by the pairs an expert gets; FP8 experts
take the 16-bit tiles in fp8 (`_fp8_tiles`) where no fp8 table is timed."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from batchgen.kernels.device import device_index, num_sms


class GemmTile(NamedTuple):
    block_n: int  # output columns a program
    block_k: int  # reduction columns a step
    warps: int
    stages: int  # software-pipeline stages of the K loop


class MoeConfig(NamedTuple):
    block_m: int  # slots a block (the align's padding unit, shared by both products)
    gate_up: GemmTile
    down: GemmTile


# (GPU name, H, I, E, k) -> {T: config}: block sizes timed best by benchmarks/fused_moe.py --tune; a
# batch of T tokens takes the entry of the nearest tuned T at or above it (else the largest)
TUNED: dict[tuple[str, int, int, int, int], dict[int, MoeConfig]] = {
    # qwen3-30b-a3b (H 2048, I 768, E 128, k 8); MoeConfig(block_m, gate_up (BLOCK_N, BLOCK_K, warps, stages), down)
    ("NVIDIA H200", 2048, 768, 128, 8): {
        1: MoeConfig(16, GemmTile(64, 128, 4, 4), GemmTile(128, 128, 4, 3)),
        8: MoeConfig(16, GemmTile(32, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        16: MoeConfig(16, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        32: MoeConfig(16, GemmTile(32, 128, 4, 4), GemmTile(128, 128, 4, 3)),
        64: MoeConfig(16, GemmTile(32, 128, 4, 4), GemmTile(128, 128, 4, 3)),
        128: MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        256: MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3)),
        512: MoeConfig(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 4)),
        1024: MoeConfig(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 8, 3)),
        2048: MoeConfig(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 8, 3)),
        4096: MoeConfig(128, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3)),
        8192: MoeConfig(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 4, 3)),
    },
    # its TP=2 shard (I 384)
    ("NVIDIA H200", 2048, 384, 128, 8): {
        1: MoeConfig(16, GemmTile(32, 128, 4, 4), GemmTile(128, 128, 4, 4)),
        16: MoeConfig(16, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        64: MoeConfig(16, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3)),
        128: MoeConfig(16, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3)),
        256: MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3)),
        512: MoeConfig(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3)),
        1024: MoeConfig(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3)),
        2048: MoeConfig(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 8, 3)),
        4096: MoeConfig(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 8, 3)),
        8192: MoeConfig(128, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3)),
    },
}


# (GPU name, H, I, E, k, "channel" | "block") -> {T: config}: FP8 experts' block sizes (benchmarks/fused_moe.py
# --tune --fp8 ...), taken as TUNED's
TUNED_FP8: dict[tuple[str, int, int, int, int, str], dict[int, MoeConfig]] = {
    # qwen3-30b-a3b, TP=1 (I 768) and its TP=2 shard (I 384)
    ("NVIDIA H200", 2048, 768, 128, 8, "channel"): {
        1: MoeConfig(16, GemmTile(64, 256, 4, 4), GemmTile(64, 128, 4, 4)),
        16: MoeConfig(16, GemmTile(64, 128, 8, 4), GemmTile(64, 128, 4, 4)),
        64: MoeConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 128, 4, 4)),
        128: MoeConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 128, 4, 3)),
        256: MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        512: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 8, 4)),
        1024: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        2048: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        4096: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        8192: MoeConfig(128, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 4)),
    },
    ("NVIDIA H200", 2048, 768, 128, 8, "block"): {
        1: MoeConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 3)),
        16: MoeConfig(16, GemmTile(64, 128, 8, 3), GemmTile(128, 128, 4, 3)),
        64: MoeConfig(16, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        128: MoeConfig(16, GemmTile(128, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        256: MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        512: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        1024: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        2048: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        4096: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        8192: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
    },
    ("NVIDIA H200", 2048, 384, 128, 8, "channel"): {
        1: MoeConfig(16, GemmTile(32, 256, 4, 4), GemmTile(128, 128, 4, 3)),
        16: MoeConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 128, 4, 4)),
        64: MoeConfig(16, GemmTile(64, 256, 4, 3), GemmTile(64, 128, 4, 4)),
        128: MoeConfig(16, GemmTile(64, 256, 4, 3), GemmTile(128, 128, 4, 4)),
        256: MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        512: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        1024: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        2048: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        4096: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        8192: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
    },
    ("NVIDIA H200", 2048, 384, 128, 8, "block"): {
        1: MoeConfig(16, GemmTile(64, 128, 4, 4), GemmTile(128, 128, 4, 4)),
        16: MoeConfig(16, GemmTile(128, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        64: MoeConfig(16, GemmTile(64, 128, 8, 3), GemmTile(128, 128, 4, 3)),
        128: MoeConfig(16, GemmTile(64, 128, 8, 3), GemmTile(128, 128, 4, 3)),
        256: MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        512: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        1024: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 4)),
        2048: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        4096: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        8192: MoeConfig(64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
    },
}


def default_config(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                   sms: int = 132) -> MoeConfig:
    """Block sizes by the pairs an expert gets on average: 16-slot blocks while that is a few (decode:
    the products stream the touched experts' weights; wide K steps keep many loads in flight, and
    32-column tiles where 64 would leave fewer than two programs an SM), larger blocks as the
    products get rows enough to be bound by the tensor cores (an expert's weights then read by fewer
    blocks)."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 8:
        blocks = min(num_tokens * top_k, num_experts)  # about one block an expert hit

        def columns(n: int) -> int:
            return 64 if blocks * triton.cdiv(n, 64) >= 2 * sms else 32

        return MoeConfig(16, GemmTile(columns(inter), 128, 4, 4), GemmTile(columns(hidden), 128, 4, 4))
    if per_expert <= 32:
        return MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3))
    if per_expert <= 96:
        return MoeConfig(64, GemmTile(64, 64, 4, 4), GemmTile(128, 64, 4, 4))
    return MoeConfig(128, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 4))


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def pick_config(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                device: torch.device, dtype: torch.dtype = torch.bfloat16, fp8: str | None = None) -> MoeConfig:
    """TUNED's entry for this GPU and shape at the nearest tuned batch at or above num_tokens, else
    default_config; for fp32 (tests, tiny models) with half the K step and at most 3 stages, so its
    tiles take the shared memory 16-bit ones do. fp8 ("channel" or "block" experts): TUNED_FP8's entry,
    else the 16-bit tiles in fp8 (_fp8_tiles)."""
    if fp8 is not None:
        by_tokens = TUNED_FP8.get((_device_key(device), hidden, inter, num_experts, top_k, fp8))
        if by_tokens:
            return _nearest(by_tokens, num_tokens)
        return _fp8_tiles(_pick_16bit_config(num_tokens, hidden, inter, num_experts, top_k, device), fp8 == "block")
    config = _pick_16bit_config(num_tokens, hidden, inter, num_experts, top_k, device)
    if dtype.itemsize <= 2:
        return config
    gate_up, down = (tile._replace(block_k=max(16, tile.block_k // 2), stages=min(tile.stages, 3))
                     for tile in (config.gate_up, config.down))
    return MoeConfig(config.block_m, gate_up, down)


def _fp8_tiles(config: MoeConfig, block: bool) -> MoeConfig:
    """16-bit tiles for e4m3 weights: the K step twice as long (the same bytes a stage; at most 128 for blocks,
    whose steps lie in one group), and column tiles narrow enough that a thread's fp32 tiles stay in its
    registers: gate/up holds four [BLOCK_M, BLOCK_N] (two sums, two steps' dots), down two."""
    def fp8(tile: GemmTile, tiles: int) -> GemmTile:
        columns = 128 * 32 * tile.warps // (tiles * config.block_m)  # (<= 128 fp32 registers a thread)
        return tile._replace(block_k=min(2 * tile.block_k, 128 if block else 256),
                             block_n=max(16, min(tile.block_n, columns)))

    return MoeConfig(config.block_m, fp8(config.gate_up, 4), fp8(config.down, 2))


def _device_key(device: torch.device) -> str:
    return _device_name(device_index(device)) if device.type == "cuda" else device.type


def _nearest(by_tokens: dict[int, MoeConfig], num_tokens: int) -> MoeConfig:
    at_or_above = [t for t in by_tokens if t >= num_tokens]
    return by_tokens[min(at_or_above) if at_or_above else max(by_tokens)]


def _pick_16bit_config(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                       device: torch.device) -> MoeConfig:
    by_tokens = TUNED.get((_device_key(device), hidden, inter, num_experts, top_k))
    if not by_tokens:
        sms = num_sms(device) if device.type == "cuda" else 132
        return default_config(num_tokens, hidden, inter, num_experts, top_k, sms)
    return _nearest(by_tokens, num_tokens)


def warmup_token_counts(hidden: int, inter: int, num_experts: int, top_k: int, max_tokens: int,
                        device: torch.device, dtype: torch.dtype = torch.bfloat16, fp8: str | None = None) -> list[int]:
    """The fewest tokens of each distinct config pick_config gives for 1 .. max_tokens tokens: a
    warm-up that runs the layer at these counts compiles every kernel a job can meet (the kernels
    specialize on their config, never on the token count)."""
    seen, counts = set(), []
    for num_tokens in range(1, max_tokens + 1):
        config = pick_config(num_tokens, hidden, inter, num_experts, top_k, device, dtype, fp8)
        if config not in seen:
            seen.add(config)
            counts.append(num_tokens)
    return counts
