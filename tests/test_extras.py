"""Optional extras (pyproject.toml): without one, what needs it fails with one line naming the extra
to install; the rest of batchgen works without it."""
import sys

import pytest

from batchgen import LLM, SamplingParams

QUEUE_HINT = "the queue needs batchgen[queue]: pip install 'batchgen[queue]'"


def without(monkeypatch, module: str, *reimported: str) -> None:
    """Makes `import module` fail as if it were not installed; forgets the batchgen modules named by the
    prefixes `reimported`, so that they import it again."""
    monkeypatch.setitem(sys.modules, module, None)
    for name in list(sys.modules):
        if name.startswith(reimported):
            monkeypatch.delitem(sys.modules, name)


def test_importing_the_queue_without_redis_names_the_extra(monkeypatch):
    without(monkeypatch, "redis", "batchgen.queue")
    with pytest.raises(ImportError) as error:
        import batchgen.queue  # noqa: F401
    assert str(error.value) == QUEUE_HINT


@pytest.mark.parametrize("command", [
    ["submit", "{input}", "--job", "j"],
    ["collect", "{output}", "--job", "j"],
    ["worker"],
])
def test_queue_commands_without_redis_fail_with_one_line(command, batchgen, monkeypatch, tmp_path):
    without(monkeypatch, "redis", "batchgen.queue")
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    args = [a.format(input=tmp_path / "in.jsonl", output=tmp_path / "out.parquet") for a in command]
    code, out, err = batchgen(*args, "--redis-url", "redis://localhost:1/0")
    assert code == 1
    assert err == f"batchgen: error: {QUEUE_HINT}\n"


def test_a_constrained_row_without_xgrammar_is_an_error_row(tiny_model, monkeypatch):
    without(monkeypatch, "xgrammar")
    llm = LLM(str(tiny_model("qwen2")), max_num_seqs=4, kv_cache_tokens=300, max_model_len=64, dtype="float32")
    rows = [{"id": "free", "prompt": "hello"},
            {"id": "json", "prompt": "hello", "response_format": {"type": "json_object"}}]
    results = {r["id"]: r for r in llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=4))}
    assert results["free"]["error"] is None and results["free"]["completion_tokens"] == 4
    assert results["json"]["finish_reason"] == "error"
    assert results["json"]["error"].endswith(
        "constrained decoding needs batchgen[structured]: pip install 'batchgen[structured]'")
