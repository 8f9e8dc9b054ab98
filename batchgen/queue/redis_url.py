"""The Redis URL of `--redis-url`: checked before use, and shown only through `redact`.

A URL is split here exactly as redis-py splits it to connect (`redis.connection.parse_url`, which
uses `urllib.parse.urlparse` and `parse_qs`), so the part `redact` hides is the part redis-py sends
as the password, whatever characters it holds.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlparse

import redis
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url

SCHEMES = ("redis", "rediss", "unix")
# Query parameters that hold a secret: the server's password, the password of the TLS client key.
SECRET_PARAMETERS = frozenset({"password", "ssl_password"})
# Query parameters shown as given next to a secret. Any other one is hidden, name and all: a
# password with an unencoded '&' goes on as a parameter of its own.
SHOWN_PARAMETERS = frozenset(URL_QUERY_ARGUMENT_PARSERS) | {
    "username", "client_name", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"}
SSL_FILES = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
ENCODE_HINT = "percent-encode / ? # in a password as %2F %3F %23"


def redact(url: str) -> str:
    """`url` for messages and logs: every password in it (user part, ?password=, ?ssl_password=)
    shown as ***. A URL without one is returned unchanged; one redis-py cannot read shows only its
    scheme."""
    try:
        parse_url(url)
        parts = urlparse(url)
        parts.port  # noqa: B018  (a port that is not a number raises, as in redis-py)
    except ValueError:
        scheme = next((s for s in SCHEMES if url.startswith(f"{s}://")), None)
        return f"{scheme}://***" if scheme else "***"
    query = parse_qsl(parts.query)  # as parse_qs splits it for redis-py: blank values dropped
    path_ok = parts.scheme == "unix" or _is_db_path(parts.path)
    if parts.password is None and not any(k in SECRET_PARAMETERS for k, _ in query) and path_ok:
        return url
    userinfo, at, hostport = parts.netloc.rpartition("@")  # where urllib splits the user part off
    if parts.password is not None:
        userinfo = f"{parts.username}:***"
    shown = [(k, v) if k in SHOWN_PARAMETERS else (k, "***") if k in SECRET_PARAMETERS else ("***", "***")
             for k, v in query]
    # params and fragment are dropped: redis-py ignores them, and an unencoded '#' in a password
    # would put the rest of it there
    text = f"{parts.scheme}://{userinfo}{at}{hostport}{parts.path if path_ok else '/***'}"
    return f"{text}?{urlencode(shown, safe='/:*')}" if shown else text


def connect(url: str) -> redis.Redis:
    """A client for `url` (redis://[user:password@]host[:port][/db], rediss:// for TLS, unix://path).
    Replies stay bytes: a field that is not UTF-8 is one malformed message, not a failed read.

    ValueError, with a one-line message that shows the URL only redacted, for a URL that redis-py
    would misread or fail on only later: a port that is not a number, a redis:// path that is not a
    database number, a query parameter redis-py does not know, a TLS file that is missing."""
    where = redact(url)
    try:
        parts = urlparse(url)
        parts.port  # noqa: B018
    except ValueError:  # urllib's message would quote the text after the ':', often a password's start
        raise ValueError(f"{where}: the host or port is malformed ({ENCODE_HINT})") from None
    if parts.scheme in ("redis", "rediss") and not _is_db_path(parts.path):
        raise ValueError(f"{where}: the path of a {parts.scheme}:// URL is the database number ({ENCODE_HINT})")
    client = redis.Redis.from_url(url, socket_timeout=15, socket_connect_timeout=5, health_check_interval=15)
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)  # builds a connection object; opens nothing
    except TypeError:  # "unexpected keyword argument NAME": NAME may be the end of a password
        raise ValueError(f"{where}: a query parameter is not a redis-py connection option "
                         f"(check its spelling; percent-encode & in a password as %26)") from None
    for name in SSL_FILES:
        path = pool.connection_kwargs.get(name)
        if path is not None and not Path(path).exists():
            raise ValueError(f"{where}: {name} file {path} does not exist")
    return client


def _is_db_path(path: str) -> bool:
    """True for a redis:// path that redis-py reads as the database number (or none given)."""
    number = path.replace("/", "")
    return number == "" or number.isdigit()
