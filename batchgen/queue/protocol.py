"""The Redis queue protocol shared by `submit`, `worker` and `collect`: key names, message fields,
and the server-side scripts that make a result and its acknowledgement one step.

Keys, all under a prefix (default ``batchgen``):

- ``P:requests``: the request stream; one entry per request, fields ``job``, ``index``, ``request``.
  Consumer group ``workers`` (created at id 0, so nothing added before the first worker is missed).
- ``P:dead``: the dead-letter stream: requests no worker could finish, and messages without a job.
- ``P:job:NAME``: a hash: ``rows`` (rows in the job), ``submitted`` (rows added so far),
  ``fingerprint``, ``input``, ``created``, and ``schema`` for a Parquet input.
- ``P:job:NAME:results``: the job's result stream; fields ``index``, ``request``, ``worker``, ``result``.
- ``P:job:NAME:workers``: a hash, worker name -> its engine and sampling settings (JSON).
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import redis

GROUP = "workers"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+=-]{0,199}")
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,99}")

# Errors that mean "Redis is not reachable right now": wait and try again. Authentication errors are
# ConnectionErrors too in redis-py, but waiting does not fix a wrong password.
RETRYABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError, redis.exceptions.TryAgainError)
FATAL = (redis.AuthenticationError, redis.exceptions.AuthorizationError, redis.exceptions.NoPermissionError)


def is_retryable(error: BaseException) -> bool:
    return isinstance(error, RETRYABLE) and not isinstance(error, FATAL)


@dataclass(frozen=True)
class Keys:
    prefix: str = "batchgen"

    def __post_init__(self) -> None:
        if not PREFIX_PATTERN.fullmatch(self.prefix):
            raise ValueError(f"invalid prefix {self.prefix!r}: use letters, digits and . _ : @ + = -")

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def job(self, name: str) -> str:
        return f"{self.prefix}:job:{name}"

    def results(self, name: str) -> str:
        return f"{self.prefix}:job:{name}:results"

    def workers(self, name: str) -> str:
        return f"{self.prefix}:job:{name}:workers"


def check_job_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"invalid job name {name!r}: use up to 200 letters, digits and . _ @ + = - (no ':')")
    return name


def ensure_group(client: redis.Redis, keys: Keys) -> None:
    """Creates the request stream and its consumer group unless they exist."""
    try:
        client.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def text(value: bytes | str | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return value.decode()


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_json_default)


def _json_default(value: Any):
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# --- messages -----------------------------------------------------------------------------------


@dataclass
class Message:
    """One entry of the request stream, decoded as far as it goes.

    `job` is None when the entry names no usable job (it goes to the dead-letter stream). Otherwise
    `request` is the request to generate, or None with `error` saying why it cannot be one (the job
    gets an error result for it)."""

    msg_id: str
    fields: dict[str, str]  # every field, decoded (undecodable bytes replaced), for the dead-letter copy
    job: str | None
    index: int | None
    request: dict | None
    error: str | None = None


def encode_request(job: str, index: int, request: dict) -> dict[str, str]:
    return {"job": job, "index": str(index), "request": to_json(request)}


def decode_request(msg_id: bytes | str, raw: dict) -> Message:
    from batchgen.io.rows import RESERVED, RowError, check_id

    msg_id = text(msg_id)
    fields: dict[str, str] = {}
    undecodable = []
    for key, value in (raw or {}).items():
        key = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        if isinstance(value, bytes):
            try:
                value = value.decode()
            except UnicodeDecodeError:
                value = value.decode("utf-8", "replace")
                undecodable.append(key)
        fields[key] = value

    def bad(error: str, job=None, index=None) -> Message:
        return Message(msg_id, fields, job, index, None, error)

    job = fields.get("job")
    if job is None or "job" in undecodable or not NAME_PATTERN.fullmatch(job):
        return bad("no job field" if job is None else f"job field {job!r} is not a job name")
    index = None
    if fields.get("index") is not None:
        if not (fields["index"].isascii() and fields["index"].isdigit()):  # (isdigit alone takes "²")
            return bad(f"index field {fields['index']!r} is not a non-negative integer", job)
        index = int(fields["index"])
    if undecodable:
        return bad(f"field {', '.join(undecodable)} is not valid UTF-8", job, index)
    if fields.get("request") is None:
        return bad("no request field", job, index)
    try:
        request = json.loads(fields["request"])
    except (json.JSONDecodeError, RecursionError) as e:
        return bad(f"request field is not JSON: {getattr(e, 'msg', 'nested too deeply')}", job, index)
    if not isinstance(request, dict):
        return bad(f"request field is not a JSON object (got {type(request).__name__})", job, index)
    if request.get("id") is None:
        if index is None:
            return bad("the request has no id and the message no index", job)
        request["id"] = index
    try:
        request["id"] = check_id(request["id"])
    except RowError as e:
        return Message(msg_id, fields, job, index, None, str(e))
    reserved = sorted(k for k in request if k in RESERVED or k.startswith("__batchgen"))
    if reserved:
        return Message(msg_id, fields, job, index, None,
                       f"field {', '.join(reserved)} of the request is reserved for the output; rename it")
    return Message(msg_id, fields, job, index, request)


def request_id_of(message: Message) -> Any:
    """The id an error result of `message` carries: the request's, else the index, else None."""
    try:
        value = json.loads(message.fields.get("request", "null"))
        if isinstance(value, dict) and isinstance(value.get("id"), (str, int)) and not isinstance(value["id"], bool):
            return value["id"]
    except (json.JSONDecodeError, RecursionError):
        pass
    return message.index


def encode_result(message_id: str, index: int | None, worker: str, result: dict, samples: int = 1) -> list[str]:
    """The result stream entry, as the flat field/value list the scripts take. samples: how many
    entries answer the message (a row with n samples: n, one per sample_index)."""
    fields = ["request", message_id, "worker", worker, "result", to_json(result)]
    if samples != 1:
        fields += ["samples", str(samples)]
    if index is not None:
        fields = ["index", str(index), *fields]
    return fields


def encode_dead_letter(message: Message, reason: str, deliveries: int | None, worker: str) -> list[str]:
    fields = ["id", message.msg_id, "message", to_json(message.fields), "reason", reason, "worker", worker,
              "at", f"{time.time():.3f}"]
    if deliveries is not None:
        fields += ["deliveries", str(deliveries)]
    return fields


# --- server-side scripts ------------------------------------------------------------------------

# Writes a message's results (one per sample; none or one for most) and/or its dead-letter copy,
# then acknowledges and deletes it, in one atomic step and only while the message is still pending
# in the group. A message that another worker has already answered is no longer pending, so a late
# second answer (a slow worker whose message was reclaimed) is dropped here: the result stream holds
# one answer per message.
#   KEYS: request stream, result stream, dead-letter stream
#   ARGV: group, message id, m, then m times (c, c result field/value items), then dead-letter items
FINISH = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then
  return 0
end
local i = 4
for _ = 1, tonumber(ARGV[3]) do
  local c = tonumber(ARGV[i])
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, i + 1, i + c))
  i = i + 1 + c
end
if #ARGV >= i then
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, i, #ARGV))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

# For each message still pending for this consumer: reset its idle time (a heartbeat, so that live
# work is not reclaimed), or, given an idle time, set it to that, so that any worker's next
# XAUTOCLAIM takes the message at once (a release). `undo` takes this worker's delivery off the
# message's count: it was stopped, not failed. Messages another consumer owns now are left alone.
#   KEYS: request stream; ARGV: group, consumer, idle ms (0: heartbeat), undo (0 or 1), message ids...
TOUCH = """
local touched = 0
local idle = tonumber(ARGV[3])
for i = 5, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p == 1 then
    if idle == 0 then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    elseif ARGV[4] == '1' then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', idle,
                 'RETRYCOUNT', math.max(p[1][4] - 1, 0), 'JUSTID')
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', idle, 'JUSTID')
    end
    touched = touched + 1
  end
end
return touched
"""

# Removes a consumer from the group if it owns no pending message (checked in the same step, so a
# message it reads meanwhile cannot be dropped with it).  KEYS: request stream; ARGV: group, consumer
DELETE_IDLE_CONSUMER = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then
  return 0
end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) + 1
"""


class Backoff:
    """Exponential backoff with jitter, for waiting on an unreachable Redis: 0.1 s doubling to 5 s."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap = first, cap
        self.failures = 0
        self.next_try = 0.0

    def failed(self) -> float:
        delay = min(self.cap, self.first * 2 ** min(self.failures, 30)) * random.uniform(0.5, 1.0)
        self.failures += 1
        self.next_try = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.next_try = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.next_try

    def wait(self) -> None:
        time.sleep(max(0.0, self.next_try - time.monotonic()))
