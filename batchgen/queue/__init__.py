"""Many workers on one Redis: `submit` puts a file's rows on a request stream, `worker`s generate
and answer on each job's result stream, `collect` writes a job's results as `batchgen run` would.
protocol.py names the keys and fields;
redis_url.py checks the Redis URL and hides its password."""

from batchgen.extras import EXTRA_OF, MissingExtra

try:  # redis and prometheus_client come with batchgen[queue]
    from batchgen.queue.collect import CollectResult, CollectTimeout, collect_job
    from batchgen.queue.protocol import Keys, check_job_name
    from batchgen.queue.redis_url import connect, redact
    from batchgen.queue.submit import SubmitError, SubmitResult, submit_job
    from batchgen.queue.worker import Worker, WorkerConfig
except ModuleNotFoundError as e:
    if e.name not in EXTRA_OF:
        raise
    raise MissingExtra(e.name) from None

__all__ = ["CollectResult", "CollectTimeout", "Keys", "SubmitError", "SubmitResult", "Worker", "WorkerConfig",
           "check_job_name", "collect_job", "connect", "redact", "submit_job"]
