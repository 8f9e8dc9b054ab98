"""Hot-path ops of the engine, one op per file.

Every file holds a Triton kernel, its launcher and a torch reference of the same op, and one public
function that picks between them: the Triton launcher for CUDA tensors, the torch reference
elsewhere (CPU runs of the engine, and the ground truth of the kernel tests).

No compile inside a job: Triton compiles a kernel once per specialization of its arguments (an int
that is 1 or a multiple of 16, a pointer that is 16-byte aligned), and the engine's warm-up
(executor/warmup.py) makes every specialization a job can meet. So an argument that varies from step
to step is never specialized: ints such as a split or part count are `do_not_specialize`, and index
arrays (rows, lengths, positions, slots, a sampler's seeds), views at any offset into a step's
staged inputs (`rows[num_decode:]`, the seeds after the top-k values), are
`do_not_specialize_on_alignment`: their loads are per row, where alignment buys nothing.
"""
from batchgen.kernels.decode_attention import decode_attention
from batchgen.kernels.gumbel_argmax import gumbel_argmax
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.rmsnorm import add_rmsnorm, rmsnorm
from batchgen.kernels.rope_store_kv import rope_store_kv
from batchgen.kernels.silu_and_mul import silu_and_mul
from batchgen.kernels.token_bitmask import apply_token_bitmask
from batchgen.kernels.unified_attention import unified_attention

__all__ = [
    "rmsnorm",
    "add_rmsnorm",
    "silu_and_mul",
    "rope_store_kv",
    "prefill_attention",
    "decode_attention",
    "unified_attention",
    "gumbel_argmax",
    "apply_token_bitmask",
]
