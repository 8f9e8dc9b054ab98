"""Where rows come from and where results go: file sources, the Parquet sink, resume and sharding."""

from batchgen.io.job import JobResult, JobSpec, run_job
from batchgen.io.resume import JobError
from batchgen.io.shard import Shard
from batchgen.io.sources import InputError, open_source

__all__ = ["InputError", "JobError", "JobResult", "JobSpec", "Shard", "open_source", "run_job"]
