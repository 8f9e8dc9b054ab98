"""Hot-path ops of the engine, one op per file.

Every file holds a Triton kernel, its launcher and a torch reference of the same op, and one public
function that picks between them: the Triton launcher for CUDA tensors, the torch reference
elsewhere (CPU runs of the engine, and the ground truth of the kernel tests).
"""
from batchgen.kernels.rmsnorm import add_rmsnorm, rmsnorm
from batchgen.kernels.rotary import apply_rotary
from batchgen.kernels.silu_and_mul import silu_and_mul
from batchgen.kernels.store_kv import store_kv
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.gumbel_argmax import gumbel_argmax
from batchgen.kernels.token_bitmask import apply_token_bitmask

__all__ = [
    "rmsnorm",
    "add_rmsnorm",
    "apply_rotary",
    "silu_and_mul",
    "store_kv",
    "prefill_attention",
    "decode_attention",
    "gumbel_argmax",
    "apply_token_bitmask",
]
