"""No Redis password in any output: every URL form redis-py accepts, through `redact` and through the
submit, collect and worker commands against a real redis-server whose users need that password."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from redis.connection import parse_url

from batchgen.queue import Keys, redact
from tests.redis_server import RedisServer, prefix, self_signed_tls, start_server  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
# Unencoded '@' and ':' in it; each piece is looked for in the output on its own.
SECRET, WRONG = "alpha7@bravo8:charlie9", "delta1@echo2:foxtrot3"
PIECES = ("alpha7", "bravo8", "charlie9", "delta1", "echo2", "foxtrot3")
USER = "alice"


def url_forms(host: str, socket: str, secret: str) -> dict[str, str]:
    """Every way redis-py takes a password, for `secret` (user alice, or the default user)."""
    encoded = quote(secret, safe="")
    return {
        "userinfo": f"redis://{USER}:{secret}@{host}/0",
        "userinfo, no user": f"redis://:{secret}@{host}/0",
        "userinfo, %40": f"redis://{USER}:{encoded}@{host}/0",
        "?password": f"redis://{host}/0?password={encoded}",
        "?password, unencoded": f"redis://{host}/0?password={secret}",
        "?username&password": f"redis://{host}/0?username={USER}&password={encoded}",
        "unix ?password": f"unix://{socket}?password={encoded}&db=0",
        "unix userinfo": f"unix://:{secret}@{socket}",
    }


def assert_no_secret(*outputs: str) -> None:
    for text in outputs:
        for piece in PIECES:
            assert piece not in text, f"{piece!r} in {text!r}"


@pytest.mark.parametrize("form", list(url_forms("h:6380", "/run/redis.sock", SECRET)))
def test_redact_hides_the_password_of_every_form(form):
    url = url_forms("h:6380", "/run/redis.sock", SECRET)[form]
    assert parse_url(url)["password"] == SECRET  # a form redis-py reads, as this password
    shown = redact(url)
    assert_no_secret(shown)
    assert "***" in shown and ("h:6380" in shown or "/run/redis.sock" in shown)
    assert parse_url(shown).get("username") == parse_url(url).get("username")


@pytest.mark.parametrize("url", [
    "rediss://alice:alpha7%40bravo8%3Acharlie9@h:6380/0?ssl_ca_certs=/etc/ca.pem",
    "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem&password=alpha7%40bravo8%3Acharlie9",
    "rediss://h:6380/0?ssl_password=alpha7%40bravo8%3Acharlie9&ssl_keyfile=/etc/key.pem",
    "redis://h:6380/0?password=alpha7&bravo8:charlie9",  # an unencoded '&': redis-py's password ends there
    "redis://h:6380/0?password=alpha7#bravo8:charlie9",  # an unencoded '#': ditto
])
def test_redact_hides_tls_and_truncated_passwords_and_leaves_other_urls_as_they_are(url):
    shown = redact(url)
    assert_no_secret(shown)
    assert "h:6380" in shown and "***" in shown
    assert "ssl_ca_certs=/etc/ca.pem" in shown or "ssl_ca_certs" not in url
    for url in ("redis://h:6380/0", "redis://alice@h/1", "rediss://h/0?ssl_ca_certs=/etc/ca.pem&socket_timeout=5",
                "unix:///run/redis.sock?db=2"):
        assert redact(url) == url


@pytest.mark.parametrize("url", ["redis://alpha7:bravo8/charlie9@h:6380/0", "redis://:1234/charlie9@h:6380/0"])
def test_a_password_with_an_unencoded_slash_is_never_echoed(url, tmp_path, batchgen):
    """urllib splits such a URL at the '/': its port or path is part of the password."""
    assert_no_secret(redact(url).replace("1234", ""))
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    code, out, err = batchgen("submit", src, "--redis-url", url, "--job", "j")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "%2F" in err, err
    assert_no_secret(out, err)


# --- the commands against a real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server whose default user needs SECRET (as requirepass) and a user alice with the same."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("secrets"), passwords=(SECRET,)).start()
    server.client().acl_setuser(USER, enabled=True, passwords=[f"+{SECRET}"], keys="*", channels="*",
                                commands=["+@all"])
    yield server
    server.stop()


def forms_of(server: RedisServer, secret: str) -> dict[str, str]:
    return url_forms(f"127.0.0.1:{server.port}", str(server.socket), secret)


@pytest.mark.parametrize("form", list(url_forms("h", "s", SECRET)))
def test_submit_and_collect_print_no_password(form, server, prefix, tmp_path, batchgen):  # noqa: F811
    url = forms_of(server, SECRET)[form]
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": "ho"}\n')
    submitted = batchgen("submit", src, "--redis-url", url, "--prefix", prefix, "--job", "j")
    assert submitted.returncode == 0 and "2 requests added" in submitted.stdout, submitted.stderr
    waited = batchgen("collect", tmp_path / "out.parquet", "--redis-url", url, "--prefix", prefix, "--job", "j",
                      "--timeout", "0.2")
    assert waited.returncode == 124 and "2 of 2 rows" in waited.stderr, waited.stderr
    assert_no_secret(*submitted[1:], *waited[1:])
    assert "127.0.0.1" in submitted.stdout or str(server.socket) in submitted.stdout


@pytest.mark.parametrize("form", list(url_forms("h", "s", SECRET)))
def test_a_wrong_password_is_one_line_that_says_what_to_fix(form, server, prefix, tmp_path, batchgen):  # noqa: F811
    url = forms_of(server, WRONG)[form]
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    for args in (["submit", src], ["collect", tmp_path / "out.parquet"]):
        code, out, err = batchgen(*args, "--redis-url", url, "--prefix", prefix, "--job", "j")
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert "AuthenticationError" in err and "check the user and password" in err and "rerun" not in err, err
        assert_no_secret(out, err)


def test_no_password_where_one_is_needed_says_what_to_fix(server, prefix, tmp_path, batchgen):  # noqa: F811
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    code, _, err = batchgen("submit", src, "--redis-url", f"redis://127.0.0.1:{server.port}/0", "--job", "j")
    assert code == 1 and "Authentication required" in err and "check the user and password" in err, err
    assert "rerun" not in err


def test_rediss_with_a_password_prints_none(tmp_path_factory, prefix, batchgen):  # noqa: F811
    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    workdir = tmp_path_factory.mktemp("tls-secrets")
    tls = self_signed_tls(workdir)
    server = RedisServer(workdir, tls=tls, passwords=(SECRET,))
    try:
        server.start()
    except RuntimeError:
        pytest.skip("this redis-server has no TLS")
    src = workdir / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    host, encoded = f"127.0.0.1:{server.port}", quote(SECRET, safe="")
    try:
        for job, url in enumerate((f"rediss://:{SECRET}@{host}/0?ssl_ca_certs={tls['ca']}",
                                   f"rediss://{host}/0?ssl_ca_certs={tls['ca']}&password={encoded}")):
            done = batchgen("submit", src, "--redis-url", url, "--prefix", prefix, "--job", f"j{job}")
            assert done.returncode == 0 and "1 requests added" in done.stdout, done.stderr
            assert_no_secret(*done[1:])
    finally:
        server.stop()


def test_a_missing_ssl_ca_certs_file_is_named(tmp_path, batchgen):
    src, missing = tmp_path / "in.jsonl", tmp_path / "no-such-ca.pem"
    src.write_text('{"prompt": "hi"}\n')
    for command in (["submit", src], ["collect", tmp_path / "out.parquet"], ["worker"]):
        code, out, err = batchgen(*command, "--redis-url", f"rediss://:{SECRET}@127.0.0.1:1/0?ssl_ca_certs={missing}",
                                  *(["--job", "j"] if command[0] != "worker" else []))
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"ssl_ca_certs file {missing} does not" in err, err
        assert_no_secret(out, err)


# --- the worker: its JSON logs, from start-up to SIGTERM ---------------------------------------------


def run_worker(url: str, model: Path, tmp: Path, prefix: str, until: str | None) -> tuple[int, str, str]:  # noqa: F811
    """`batchgen worker` in a subprocess, with JSON logs: stopped by SIGTERM once the log has the
    event `until` (None: it stops by itself) -> (exit code, stdout, stderr)."""
    out, err = tmp / "worker.out", tmp / "worker.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "batchgen.cli", "worker", "--redis-url", url, "--prefix", prefix, "--log-format",
             "json", "--model", str(model), "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "2"],
            stdout=stdout, stderr=stderr, cwd=REPO)
        try:
            deadline = time.monotonic() + 300
            while until is not None and process.poll() is None and time.monotonic() < deadline:
                if any(json.loads(line).get("event") == until
                       for line in err.read_text().splitlines() if line.startswith("{")):
                    process.send_signal(signal.SIGTERM)
                    break
                time.sleep(0.2)
            code = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    return code, out.read_text(), err.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("form", ["?password", "userinfo"])
def test_the_worker_logs_no_password(form, server, prefix, tmp_path, tiny_model):  # noqa: F811
    code, out, err = run_worker(forms_of(server, SECRET)[form], tiny_model("llama"), tmp_path, prefix, "serving")
    assert code == 0, err[-3000:]
    assert any("loading the engine" in json.loads(line)["message"] for line in err.splitlines() if line.startswith("{"))
    assert_no_secret(out, err)
    assert server.client().exists(Keys(prefix).requests)  # it did connect with that password


@pytest.mark.slow
def test_the_worker_with_a_wrong_password_says_what_to_fix(server, prefix, tmp_path, tiny_model):  # noqa: F811
    code, out, err = run_worker(forms_of(server, WRONG)["?password"], tiny_model("llama"), tmp_path, prefix, None)
    assert code == 1 and "check the user and password" in err and "rerun" not in err, err[-3000:]
    assert_no_secret(out, err)


def test_an_index_of_other_digits_is_a_malformed_message_not_a_crash():
    """"²" and "٣" are digits to str.isdigit but not to int(): the message is refused, with its reason."""
    from batchgen.queue.protocol import decode_request

    for index in ("²", "٣", "-1", "1.5"):
        message = decode_request(b"1-1", {b"job": b"j", b"index": index.encode(), b"request": b'{"prompt": "x"}'})
        assert message.error == f"index field {index!r} is not a non-negative integer", message.error
