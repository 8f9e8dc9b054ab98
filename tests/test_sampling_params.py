"""SamplingParams checks its values as a row's fields are checked (schema.check_options): a bad one is a
ValueError naming its field, with the row's message, when it is made (or replaced), never a TypeError or a
failure in the middle of a job; a bool is not a number and a stop string is one stop."""
import pytest

from batchgen import SamplingParams
from batchgen.schema import check_options

BAD = [
    ("ignore_eos", "false"),
    ("ignore_eos", 1),
    ("stop", ["a", 5]),
    ("stop", ""),
    ("stop", [""]),
    ("stop", 5),
    ("max_tokens", "3"),
    ("max_tokens", True),
    ("temperature", "0.5"),
    ("temperature", True),
    ("top_p", "1"),
    ("top_k", 1.5),
    ("n", True),
    ("seed", True),
    ("min_tokens", "0"),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", 5),
]


def row_message(field, value) -> str:
    with pytest.raises(ValueError) as refused:
        check_options({field: value})
    return str(refused.value)


@pytest.mark.parametrize("field, value", BAD)
def test_a_bad_value_is_a_value_error_with_the_rows_message(field, value):
    with pytest.raises(ValueError) as refused:
        SamplingParams(**{field: value})
    message = str(refused.value)
    assert message == row_message(field, value) and message.startswith(field), message
    with pytest.raises(ValueError, match=f"^{field}"):  # replace() checks what it changes, too
        SamplingParams().replace(**{field: value})


@pytest.mark.parametrize("field", ["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "n", "ignore_eos"])
def test_none_is_refused_where_it_means_nothing(field):
    with pytest.raises(ValueError, match=f"^{field} must be .*, got None"):
        SamplingParams(**{field: None})


def test_good_values_take_the_rows_forms():
    params = SamplingParams(stop="ab", max_tokens=4.0, temperature=0, stop_token_ids=(3,), seed=None)
    assert params.stop == ["ab"]  # one stop string, not its characters
    assert params.max_tokens == 4 and type(params.max_tokens) is int
    assert params.temperature == 0.0 and type(params.temperature) is float and params.greedy
    assert params.stop_token_ids == [3] and params.seed is None
    assert SamplingParams(stop=None).stop == [] and SamplingParams().replace(stop="x").stop == ["x"]
