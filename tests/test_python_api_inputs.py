"""LLM.generate / generate_list take what a user hands them: a repeated id, a request that is not a dict, a
None in a list, a lone string. Each bad request is one error row, never an exception or a second row, and
generate_list gives exactly one result per request, in request order."""
import pytest

from batchgen import LLM, SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("qwen2")), max_num_seqs=4, kv_cache_tokens=200, max_model_len=128)


def summary(results):
    return [(r["id"], r["error"]) for r in results]


@pytest.mark.parametrize("requests, message", [
    ([{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}], "id 1 already seen in this input"),
    ([{"id": 1, "prompt": "a"}, {"id": "1", "prompt": "b"}], "id '1' already seen in this input"),  # ids are text
    (["a", {"id": 0, "prompt": "b"}], "id 0 is taken: row 0 has no id, and a row without an id takes its 0-based "
                                      "index as id; give every row an id, or none"),  # a string's id is its place
    ([{"id": 1, "prompt": "a"}, "b"], "the row has no id and its index 1 is already another row's id"),
])
def test_a_repeated_id_is_an_error_row_and_each_request_has_one_result(llm, requests, message):
    """As in a file: the second request with an id is an error row under the fallback id #row:N."""
    results = llm.generate_list(requests, ONE)
    assert len(results) == 2
    assert results[0]["error"] is None and results[0]["completion_tokens"] == 1
    assert summary(results[1:]) == [("#row:1", message)] and results[1]["finish_reason"] == "error"
    streamed = sorted(summary(llm.generate(requests, ONE)), key=str)
    assert streamed == sorted(summary(results), key=str)


def test_a_repeated_ids_error_row_keeps_its_other_columns(llm):
    first, second = llm.generate_list([{"id": "q", "prompt": "a"}, {"id": "q", "prompt": "b", "source": "s"}], ONE)
    assert first["error"] is None and second["source"] == "s" and "already seen" in second["error"]


def test_requests_that_are_not_dicts_are_error_rows_under_the_fallback_id(llm):
    """#row:N, N their place, as a Parquet row without a usable id; a None in a list is such a request."""
    results = llm.generate_list(["Hi", None, {"id": "z", "prompt": "Ok"}], ONE)
    assert summary(results) == [(0, None), ("#row:1", "a request must be a dict or a string, got None"), ("z", None)]
    results = llm.generate_list(["Hi", 5, ["x"]], ONE)
    assert summary(results) == [(0, None), ("#row:1", "a request must be a dict or a string, got int"),
                                ("#row:2", "a request must be a dict or a string, got list")]
    assert sorted(summary(llm.generate(["Hi", 5, ["x"]], ONE)), key=str) == sorted(summary(results), key=str)
    assert summary(llm.generate_list([{"id": None, "prompt": "Hi"}], ONE)) == [(0, None)]  # a null id: none


@pytest.mark.parametrize("request_, message", [
    ({"id": [1, 2], "prompt": "hi"}, "id must be a string or an integer, got list"),
    ({"id": "", "prompt": "hi"}, "id is an empty string"),
    ({"id": 2**70, "prompt": "hi"}, "id must be"),
    ({"id": 1.5, "prompt": "hi"}, "id must be a string or an integer, got float"),
    ({"id": "#row:7", "prompt": "hi"}, "has the form of the ids batchgen gives"),
    ({"id": "z\ud800", "prompt": "hi"}, "id is not valid Unicode"),
    ({"id": "x", "prompt": "hi", "text": "mine"}, "column text is reserved for the output"),
    ({"id": "w", "prompt": "hi", "col": "bad\ud800"}, "column col is not valid Unicode"),
])
def test_ids_and_columns_are_checked_as_a_files_are(llm, request_, message):
    """The README's row checks hold on this path too: the id's type and range, the fallback ids' form, reserved
    output columns, text that no writer could store."""
    good, bad = llm.generate_list([{"id": "good", "prompt": "a"}, request_], ONE)
    assert good["error"] is None and message in bad["error"] and bad["finish_reason"] == "error"


def test_a_live_sources_none_is_no_request_and_takes_no_place(llm):
    def source():
        yield "a"
        yield None
        yield "b"

    assert sorted(r["id"] for r in llm.generate(source(), ONE)) == [0, 1]


def test_a_lone_string_or_dict_is_one_request(llm):
    """vLLM's generate("Hello"): one prompt, not one per character (nor one per key of a dict)."""
    assert summary(llm.generate_list("Hello", ONE)) == [(0, None)]
    assert summary(llm.generate("Hello", ONE)) == [(0, None)]
    assert summary(llm.generate_list({"id": "d", "prompt": "Hello"}, ONE)) == [("d", None)]


def test_requests_of_batchgens_own_layers_keep_their_ids(llm):
    """The queue worker and the file job tag their requests (__batchgen_*) and check ids in their own scope
    (a queue worker serves many jobs in one generate): repeated ids there are not refused."""
    requests = [{"id": 1, "prompt": "a", "__batchgen_msg__": "m1"}, {"id": 1, "prompt": "b", "__batchgen_msg__": "m2"}]
    results = list(llm.generate(requests, ONE))
    assert sorted(r["__batchgen_msg__"] for r in results) == ["m1", "m2"]
    assert all(r["id"] == 1 and r["error"] is None for r in results)
