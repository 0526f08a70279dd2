from typing import Any, Literal

import pytest

from vit_service.value_types import type_problem


@pytest.mark.parametrize(("value", "annotation"), [
    (3, int), (3, float), (2.5, float), (True, bool), ("x", str), (None, int | None),
    (None, float | None), (2, float | None), ("cls", Literal["cls", "mean"]),
    ([0.9, 0.99], tuple[float, float]), ((0.9, 1), tuple[float, float]),
    ([[0.5, 16]], list[tuple[float, int]]), ({"a": [1, "b"]}, dict[str, Any]),
    ("a", str | list[str]), (["a", "b"], str | list[str]), (object(), Any),
])
def test_a_value_of_its_type_passes(value: Any, annotation: Any) -> None:
    assert type_problem(value, annotation) is None


@pytest.mark.parametrize(("value", "annotation", "says"), [
    (True, int, "expected an integer, got True"),  # pydantic's lax mode: 1
    (False, float, "expected a number, got False"),
    ("3", int, "expected an integer, got '3'"),  # a JSON string is no number
    (2.5, int, "expected an integer"), (1, bool, "expected true or false, got 1"),
    ("yes", bool, "expected true or false"), (5, str, "expected a string, got 5"),
    (True, int | None, "expected an integer"), (3, Literal["cls", "mean"], "one of 'cls'"),
    (True, Literal[1, 2], "one of 1, 2"),  # True == 1, but no Literal 1
    ([0.9], tuple[float, float], "expected 2 items, got [0.9]"),
    ([0.9, True], tuple[float, float], "expected a number, got True"),
    ([[0.5, True]], list[tuple[float, int]], "expected an integer, got True"),
    (0.5, list[int], "expected a list"), ([1], dict[str, Any], "expected a mapping"),
    ("x" * 100, int, "..."),  # a long value is shown cut
    (True, Literal["cifar10", "imdb"] | str, "expected one of 'cifar10', 'imdb' or a string"),
    (5, str | None, "expected a string or null, got 5"),
    (["a", 1], str | list[str], "expected a string, got 1"),  # the item that does not fit
])
def test_a_value_of_another_type_is_named(value: Any, annotation: Any, says: str) -> None:
    problem = type_problem(value, annotation)
    assert problem is not None and says in problem, problem
    assert len(problem) < 80
