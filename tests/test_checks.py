"""fastgemma.checks: what counts as an integer setting (configs and files hand these in)."""
import pytest

from fastgemma.checks import is_int, is_int_list


@pytest.mark.parametrize("v, lo, hi, want", [
    (3, None, None, True), (0, 0, None, True), (-1, 0, None, False), (16, 1, 15, False), (15, 1, 15, True),
    (True, None, None, False), (False, 0, 1, False),  # YAML's true / false are no counts
    (2.0, None, None, False), ("2", None, None, False), (None, None, None, False),
])
def test_is_int(v, lo, hi, want):
    assert is_int(v, lo, hi) is want


@pytest.mark.parametrize("v, want", [
    ([], True), ([1, 2, 3], True), ([1, True], False), ([1, 2.0], False), ((1, 2), False), ("12", False), (None, False),
])
def test_is_int_list(v, want):
    assert is_int_list(v) is want
