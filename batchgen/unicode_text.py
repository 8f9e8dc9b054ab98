"""Strings that UTF-8 cannot encode: a lone surrogate (U+D800-U+DFFF) is valid JSON ("\\ud800") and a
valid Python str, but no tokenizer, Parquet writer or Redis client takes it. A row's strings are
checked before they go anywhere (the row becomes an error row naming the field), and the strings an
error row carries back are made writable (each lone surrogate becomes U+FFFD, as a UTF-8 decoder's
"replace" does)."""
from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


class TextError(ValueError):
    """A string holds a lone surrogate; the message names where (one line)."""


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None (the usual case, without a scan for
    ASCII text; no copy of the text either way)."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


def check_text(name: str, text: str) -> None:
    """TextError when `text` (the value of field `name`) holds a lone surrogate."""
    at = lone_surrogate(text)
    if at is not None:
        raise TextError(f"{name} is not valid Unicode: lone surrogate at character {at}")


def check_nested_text(name: str, value: Any) -> None:
    """check_text on every string in `value` (nested lists and objects, their keys too), naming the
    first bad one by its path from `name`: messages[0].content, meta.tags[2]. Iterative: a value
    nested deeply does not exhaust the stack; a list of numbers costs a type check an item."""
    todo = [(name, value)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            check_text(path, value)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not key.isascii() and lone_surrogate(key) is not None:
                    raise TextError(f"a key of {path or 'the row'} is not valid Unicode: "
                                    f"lone surrogate at character {lone_surrogate(key)}")
                if isinstance(item, str):
                    if not item.isascii():
                        check_text(f"{path}.{key}" if path else str(key), item)
                elif isinstance(item, _CONTAINERS):
                    todo.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, str):
                    if not item.isascii():
                        check_text(f"{path}[{i}]", item)
                elif isinstance(item, _CONTAINERS):
                    todo.append((f"{path}[{i}]", item))


_CONTAINERS = (dict, list, tuple)


def holds_lone_surrogate(value: Any) -> bool:
    """Whether any string in `value` (nested, keys too) holds a lone surrogate."""
    try:
        check_nested_text("", value)
    except TextError:
        return True
    return False


def writable(value: Any) -> Any:
    """`value` with each lone surrogate in its strings (nested, keys too) replaced by U+FFFD: for the
    values an error row carries back to a writer. The value itself where it has none."""
    return _replaced(value) if holds_lone_surrogate(value) else value


def _replaced(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub(REPLACEMENT, value)
    if isinstance(value, dict):
        return {_replaced(k): _replaced(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_replaced(v) for v in value)
    return value
