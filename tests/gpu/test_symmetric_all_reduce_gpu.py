"""On two GPUs: the engine's all-reduce through symmetric memory (parallel/symmetric_all_reduce.py).

- It gives NCCL's sums bit for bit (two ranks: one rounding of a + b either way), run eagerly and
  replayed from a CUDA graph with new inputs, also from a tensor written into its buffer (summed there, in
  place); tensors it does not take (over 64 MiB, fp32, a size
  that would misalign a rank's slice) go to NCCL and give the same.
- A rank killed in the middle of a job: rank 0 reports it, as with NCCL, and its process still ends
  (the symmetric kernel cannot be aborted; the test runs the engine in a child process).
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from batchgen.parallel.tensor_parallel import connect

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

# rows, hidden, dtype, taken by the symmetric path
CASES = [
    (1, 4096, torch.bfloat16, True),
    (7, 2048, torch.bfloat16, True),
    (256, 4096, torch.bfloat16, True),
    (8192, 4096, torch.bfloat16, True),  # exactly 64 MiB: a prefill step's
    (8193, 4096, torch.bfloat16, False),  # over the limit
    (5, 96, torch.bfloat16, False),  # 480 elements: not a multiple of 64
    (16, 4096, torch.float32, False),
]


def _nccl_sum(tp, x):
    y = x.clone()
    tp.group.allreduce([y]).wait()
    return y


def _rank(rank, store_path):
    torch.cuda.set_device(rank)
    tp = connect(store_path, rank, 2, torch.device("cuda", rank))
    assert tp.symmetric is not None, "GPUs with peer access should use symmetric memory"
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    for rows, hidden, dtype, symmetric in CASES:
        assert tp.symmetric.fits(torch.empty(rows, hidden, dtype=dtype, device="cuda")) == symmetric
        x = torch.randn(rows, hidden, generator=gen, device="cuda", dtype=dtype)
        assert torch.equal(tp.all_reduce(x.clone()), _nccl_sum(tp, x)), (rows, hidden, dtype)
        staged = tp.reduce_buffer(rows, hidden, dtype)  # a product's output written into the buffer itself
        assert (staged is not None) == symmetric
        if staged is not None:
            staged.copy_(x)
            summed = tp.all_reduce(staged)  # in place: the sum stays in the buffer
            assert summed.data_ptr() == staged.data_ptr() and torch.equal(summed, _nccl_sum(tp, x))

        static = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tp.all_reduce(static)  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tp.all_reduce(static)
        for _ in range(3):  # new inputs each replay: nothing of the last call stays in the buffer
            x = torch.randn(rows, hidden, generator=gen, device="cuda", dtype=dtype)
            static.copy_(x)
            graph.replay()
            assert torch.equal(static, _nccl_sum(tp, x)), (rows, hidden, dtype, "graph")
        torch.cuda.synchronize()
        graph.reset()
    tp.close_symmetric()


def test_symmetric_all_reduce_equals_nccl():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(str(Path(tmp) / "store"),), nprocs=2)


KILL_RANK_1 = r"""
import os, signal, sys
from multiprocessing.connection import wait
from batchgen import LLM, SamplingParams
from batchgen.executor.tp_workers import TensorParallelError, TPWorkers

real_send, calls = TPWorkers.send, []


def send(self, inputs):
    calls.append(1)
    if len(calls) == 6:  # decode steps by then: every all-reduce of the step goes the symmetric way
        os.kill(self.pids[0], signal.SIGKILL)
        wait([self.procs[0].sentinel])
    return real_send(self, inputs)


if __name__ == "__main__":  # the workers start by spawn and import this module
    device, dtype = os.environ.get("DEVICE", "cuda"), os.environ.get("DTYPE", "bfloat16")
    llm = LLM(sys.argv[1], dtype=dtype, device=device, tensor_parallel_size=2, max_num_seqs=8,
              max_num_batched_tokens=16)
    assert (llm.engine.runner.tp.symmetric is not None) == (device == "cuda")
    TPWorkers.send = send
    try:
        llm.generate_list([{"prompt_token_ids": [1, 2, 3, 4, 5]}] * 4, SamplingParams(temperature=0, max_tokens=40))
    except TensorParallelError as e:
        print("ERROR", e, flush=True)
    llm.close()
    print("CLOSED", flush=True)
"""


def test_killed_rank_with_symmetric_all_reduce_still_ends(tiny_model, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_RANK_1)
    paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    done = subprocess.run([sys.executable, str(script), str(tiny_model("llama"))], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    assert "ERROR tensor-parallel rank 1 failed: its process was killed by SIGKILL" in done.stdout, done.stderr[-3000:]
    assert "CLOSED" in done.stdout and done.returncode == 0, done.stderr[-3000:]


TWO_ENGINES = r"""
import sys
from batchgen import LLM, SamplingParams

if __name__ == "__main__":  # the workers start by spawn and import this module
    paths, tokens = [], []
    for _ in range(2):  # the second engine's workers are fresh processes; rank 0 is not
        llm = LLM(sys.argv[1], dtype="bfloat16", tensor_parallel_size=2, max_num_seqs=8)
        paths.append(llm.describe()["tensor_parallel_all_reduce"])
        rows = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7, 8]}]
        tokens.append([r["output_token_ids"]
                       for r in llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=12))])
        llm.close()
    print("PATHS", paths, flush=True)
    print("SAME", tokens[0] == tokens[1], flush=True)
"""


def test_a_second_engine_in_a_process_uses_nccl(tiny_model, tmp_path):
    """torch's rendezvous numbers its store exchanges per process: a second engine (fresh workers,
    rank 0's counter further on) hung in it. Only a process's first engine uses symmetric memory."""
    script = tmp_path / "two.py"
    script.write_text(TWO_ENGINES)
    paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    done = subprocess.run([sys.executable, str(script), str(tiny_model("llama"))], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PATHS ['symmetric memory up to 64 MiB of bf16, NCCL above', 'NCCL']" in done.stdout, done.stdout
    assert "SAME True" in done.stdout
