"""Vocabulary-parallel embedding and LM head: rank r holds rows [r * R, (r+1) * R) of the (padded)
vocabulary, R = V/tp rounded up to whole groups of the sampler (kernels/gumbel_argmax.GROUP: each rank
samples from its own shard, executor/sampling.py). The embedding zeroes ids of other ranks and
all-reduces; the head computes its slice of the logits and gathers them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.gumbel_argmax import GROUP
from batchgen.kernels.invariant_gemm import invariant_gemm
from batchgen.layers.packed_linear import PackableWeight, stream_product, streams_weight
from batchgen.parallel.tensor_parallel import SINGLE, TensorParallel


def vocab_rows_per_rank(vocab_size: int, tp_size: int) -> int:
    """Rows of the vocabulary a rank holds: all of them at TP=1; else V/tp rounded up to whole groups."""
    return vocab_size if tp_size == 1 else -(-vocab_size // (tp_size * GROUP)) * GROUP


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = vocab_rows_per_rank(vocab_size, tp.size)
        self.start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        rows = loaded[self.start : self.start + self.rows_per_rank]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(PackableWeight, VocabParallelEmbedding):
    fp32_product: bool | None = None  # whether torch.mm writes fp32 from bf16 here (CUDA, torch >= 2.8)

    def forward(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """hidden [S, H] (only the tokens that sample) -> logits [S, vocab] in fp32 (fp32=False: in
        hidden's dtype where shard_logits can)."""
        if self.tp.size == 1:
            return self.shard_logits(hidden, fp32)
        logits = self.tp.all_gather_last_dim(self.matmul(hidden))
        return logits[:, : self.vocab_size].float()

    def shard_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """hidden [S, H] -> this rank's logits [S, V'] in fp32: token ids start + [0, V'), the real
        vocabulary's part of its rows (all of it at TP=1; executor/sampling.py). fp32=False on a
        GPU: in hidden's 16-bit dtype, as HF transformers' and vLLM's LM heads write them (a step that
        only samples them: model_runner.ModelRunner.logits_dtype); half the bytes to write and read back."""
        real = max(0, min(self.rows_per_rank, self.vocab_size - self.start))
        if self.batch_invariant and hidden.is_cuda:  # (fp32 straight from the kernel's sums)
            return invariant_gemm(hidden, self.weight, out_dtype=torch.float32 if fp32 else hidden.dtype)[:, :real]
        logits = None
        if hidden.is_cuda and hidden.dtype != torch.float32:
            if streams_weight(hidden):  # one row: the skinny kernel streams the head faster than cuBLAS
                return stream_product(hidden, self.weight, out_dtype=torch.float32 if fp32 else hidden.dtype)[:, :real]
            logits = self._fp32_product(hidden) if fp32 else self.matmul(hidden)
        if logits is None:
            logits = self.matmul(hidden).float()
        return logits[:, :real]

    def _fp32_product(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits straight from the product (no bf16 [S, V] result and its conversion); None where
        torch cannot."""
        if self.fp32_product is False:
            return None
        try:
            logits = torch.mm(hidden, self.weight.t(), out_dtype=torch.float32)
        except torch.cuda.OutOfMemoryError:  # a real failure, not a missing feature
            raise
        except (TypeError, RuntimeError, NotImplementedError):
            ParallelLMHead.fp32_product = False
            return None
        ParallelLMHead.fp32_product = True
        return logits
