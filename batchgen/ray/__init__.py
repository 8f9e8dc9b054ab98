"""A Ray Data stage (the `batchgen[ray]` extra): `Generate`, a callable class for `Dataset.map_batches`.

    ds.map_batches(Generate, fn_constructor_kwargs={"model": ..., "sampling": {...}, **engine_options},
                   batch_size=256, compute=ActorPoolStrategy(size=4, max_tasks_in_flight_per_actor=4),
                   max_concurrency=2, num_gpus=TP)

Each actor builds one engine (`LLM`) in __init__. The input rows are `batchgen run`'s; each batch comes
back in the format it came in (Ray's default dict of numpy arrays, pandas, pyarrow) with one row per
result (a row with n samples gives n rows): its input columns, then `run`'s output columns. A bad row
becomes an error row; the stage never raises for one.

Pipelining. `__call__` is a coroutine, so Ray Data runs it on the actor's event loop and lets several
batches be in it at once (up to 4 of one task's batches, and `max_concurrency` tasks). The engine runs
on one thread for the actor's life, pulling requests from a queue (engine_thread.py): a batch puts its
rows there and awaits its results, so the rows of the next batch join the engine's running batch while
the current batch's last rows finish, and the device need not drain between Ray batches.
"""
from batchgen.ray.generate import Generate

__all__ = ["Generate"]
