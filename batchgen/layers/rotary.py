"""Rotary embedding: the cos/sin table for every position, with rope scaling folded in.

inv_freq[i] = theta^(-2i / D);   angle(p, i) = p * inv_freq[i];   cache[p] = [cos(angle) | sin(angle)]
  linear:  inv_freq / factor
  llama3:  low frequencies (wavelength > L / low_freq_factor) divided by factor, high ones kept,
           the band between interpolated smoothly (L = original_max_position_embeddings).
The rotation itself runs in layers/attention.py, fused with the KV store (kernels/rope_store_kv.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        self.register_buffer("cos_sin_cache", torch.cat((angles.cos(), angles.sin()), dim=-1), persistent=False)
