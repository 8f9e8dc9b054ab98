"""Data parallelism: N engine replicas, each in a child process with its own GPU (or its own tensor-
parallel group of GPUs), fed from one reader and collected into one stream of results.

Rows go to replicas as each has room (a replica holds at most as many rows as one engine looks ahead
at), each to the replica with the least work outstanding (its rows' prompt and output tokens, as far as
they are known before tokenizing), so that the replicas finish together and a faster one takes more.
Rows that look alike at the start (a shared system prompt, a shared prefix) go to the replica that had
that prefix before, where it has room, so its prefix cache still pays. A row's n samples stay together.

A replica that dies (a CUDA error, out of memory, SIGKILL) loses no rows: the samples it had not
returned go to the others. A row that was on two replicas that died becomes an error row. When every
replica is gone, generate() raises ReplicaError naming the last one and why; the results already given
stand, and a rerun of the job completes it. Replicas end with their parent (parallel/processes.py).

Messages, parent -> replica: ("job", defaults, threaded), ("rows", [row, ...]), ("end",) (no more rows
in this job), ("stop",) (stop now, as on SIGTERM), ("close",). Replica -> parent: ("row", result) and
("done", stats) at the end of each job.
"""
from batchgen.replicas.placement import data_parallel_size, prefix_key
from batchgen.replicas.pool import ReplicaError, ReplicaPool

__all__ = ["ReplicaError", "ReplicaPool", "data_parallel_size", "prefix_key"]
