"""Store the K/V of the step's new tokens into their slots of the token pool:
    k_cache[out_slots[t]] = k[t],  v_cache[out_slots[t]] = v[t]
"""
import torch


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor
) -> None:
    k_cache[out_slots] = k.to(k_cache.dtype)
    v_cache[out_slots] = v.to(v_cache.dtype)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor
) -> None:
    """k, v: [T, Hk, D]; k_cache, v_cache: [num_slots, Hk, D]; out_slots: [T] int."""
    store_kv_ref(k, v, k_cache, v_cache, out_slots)
