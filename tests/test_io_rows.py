"""Row checks (batchgen.io.rows): every input row becomes a request or an error result, never an exception."""

import pytest

from batchgen.io.rows import ROW_KEY, IdSet, InputRow, RowChecker


def check(data, index=0, checker=None):
    return (checker or RowChecker()).check(InputRow(index, data))


def test_good_row_becomes_a_request_with_overrides_and_carried_columns():
    request, error = check({"id": "a", "prompt": "hi", "max_tokens": 4.0, "temperature": 0, "stop": "\n",
                            "ignore_eos": True, "lang": "en", "meta": {"k": [1]}}, index=7)
    assert error is None
    assert request == {"id": "a", "prompt": "hi", "max_tokens": 4, "temperature": 0.0, "stop": ["\n"],
                       "ignore_eos": True, "lang": "en", "meta": {"k": [1]}, ROW_KEY: 7}
    assert isinstance(request["max_tokens"], int)


def test_row_without_id_gets_its_index_and_nulls_mean_absent():
    request, error = check({"prompt": "hi", "id": None, "messages": None, "top_k": None}, index=5)
    assert error is None and request["id"] == 5 and "messages" not in request and "top_k" not in request


def test_messages_drop_null_struct_fields():
    request, _ = check({"messages": [{"role": "user", "content": "hi", "name": None}]})
    assert request["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "data, fragment",
    [
        ([1, 2], "not a JSON object (got an array)"),
        ("text", "not a JSON object (got a string)"),
        ({"id": "x"}, "no prompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "more than one prompt field (prompt, prompt_token_ids)"),
        ({"prompt": ["a"]}, "prompt must be a string, got list"),
        ({"prompt": ""}, "prompt is empty"),
        ({"messages": []}, "messages is empty"),
        ({"messages": "hi"}, "messages must be a list"),
        ({"messages": [{"role": "user", "content": 3}]},
         "messages[0].content must be a string or a list of text parts, got int"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role is empty"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages has no content"),
        ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids[1] must be an integer, got bool"),
        ({"prompt": "a", "max_tokens": 1.5}, "max_tokens must be an integer, got float 1.5"),
        ({"prompt": "a", "temperature": "hot"}, "temperature must be a number, got str"),
        ({"prompt": "a", "stop": [1]}, "stop[0] must be a string, got int"),
        ({"prompt": "a", "stop": ["x", None]}, "stop[1] must be a string, got null"),
        ({"prompt": "a", "stop": 5}, "stop must be a string or a list of strings, got int"),
        ({"prompt_token_ids": [1, None, 3]}, "prompt_token_ids[1] must be an integer, got null"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0] is a text part without a 'text' string"),
        ({"prompt": "a", "stop": [""]}, "stop holds an empty string"),
        ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"prompt": "a", "id": [1]}, "id must be a string or an integer, got list"),
        ({"prompt": "a", "id": ""}, "id is an empty string"),
        ({"prompt": "a", "finish_reason": "x"}, "column finish_reason is reserved for the output"),
        ({"prompt": "a", ROW_KEY: 1}, "reserved for the output"),
    ],
)
def test_bad_rows_become_error_results(data, fragment):
    request, error = check(data, index=3)
    assert request is None
    assert fragment in error["error"] and "\n" not in error["error"]
    assert error["finish_reason"] == "error" and error["text"] is None and error["output_token_ids"] == []
    assert error[ROW_KEY] == 3


def test_unreadable_row_keeps_its_reason():
    _, error = RowChecker().check(InputRow(9, None, "not JSON: Expecting value at column 1"))
    assert error["id"] == "#row:9" and error["error"] == "not JSON: Expecting value at column 1"


def test_error_rows_carry_the_other_columns():
    _, error = check({"id": "x", "lang": "fr"})
    assert error["id"] == "x" and error["lang"] == "fr"


def test_duplicate_id_is_an_error_and_takes_the_rows_fallback_id():
    checker = RowChecker()
    assert check({"id": "a", "prompt": "x"}, 0, checker)[1] is None
    _, error = check({"id": "a", "prompt": "y"}, 1, checker)
    assert error["id"] == "#row:1" and "id 'a' already seen" in error["error"]
    # ids compare as text: 7 and "7" are the same id
    assert check({"id": 7, "prompt": "x"}, 2, checker)[1] is None
    assert "already seen" in check({"id": "7", "prompt": "x"}, 3, checker)[1]["error"]


def test_a_row_whose_index_is_taken_as_an_id_is_an_error():
    checker = RowChecker()
    check({"id": 1, "prompt": "x"}, 0, checker)
    _, error = check({"prompt": "y"}, 1, checker)
    assert "no id and its index 1 is already another row's id" in error["error"]


def test_an_id_that_is_an_earlier_rows_index_names_that_row():
    """An explicit id equal to the index an earlier row without an id took: the message says whose it is, not
    'already seen' (the user gave that id once)."""
    checker = RowChecker()
    for index in range(12):
        assert check({"prompt": "x"}, index, checker)[1] is None
    assert check({"id": 20, "prompt": "x"}, 12, checker)[1] is None
    for index, row_id in enumerate([0, "11", 7], start=13):
        _, error = check({"id": row_id, "prompt": "y"}, index, checker)
        assert error["id"] == f"#row:{index}"
        assert error["error"].startswith(f"id {row_id!r} is taken: row {row_id} has no id, and a row without an id")
    _, error = check({"id": 20, "prompt": "y"}, 16, checker)  # an explicit id seen twice: as before
    assert error["error"] == "id 20 already seen in this input"
    _, error = check({"id": "011", "prompt": "y"}, 17, checker)  # not an index's text: a new id
    assert error is None


def test_id_of_a_bad_row_still_counts_as_seen():
    checker = RowChecker()
    assert check({"id": "a"}, 0, checker)[1] is not None  # no prompt
    assert "already seen" in check({"id": "a", "prompt": "x"}, 1, checker)[1]["error"]


def test_integral_float_ids_are_integers():
    request, _ = check({"id": 4.0, "prompt": "x"})
    assert request["id"] == 4 and isinstance(request["id"], int)


def test_id_set():
    ids = IdSet()
    assert ids.add("a") and ids.add(1) and not ids.add("a") and not ids.add("1")


@pytest.mark.parametrize("field, value, ok", [
    ("spaces_between_special_tokens", False, False), ("spaces_between_special_tokens", True, True),
    ("spaces_between_special_tokens", 0, False),
])
def test_vllm_fields_batchgen_does_not_do_are_error_rows_unless_at_their_default(field, value, ok):
    """Not carried through as a column while the row samples without them."""
    request, error = check({"prompt": "x", field: value}, 0, RowChecker())
    if ok:
        assert error is None
    else:
        assert request is None and error["error"].startswith(f"{field} ")
        assert "is not supported (only its default)" in error["error"]
