"""Checks of values that come from configs and files: what an integer setting is allowed to be."""


def is_int(v, lo: int | None = None, hi: int | None = None) -> bool:
    """v an integer (not a bool: YAML's `true` is no count) within [lo, hi] where they are given."""
    return isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo) and (hi is None or v <= hi)


def is_int_list(v) -> bool:
    """v a list of integers (bools refused, as in is_int); an empty list is one."""
    return isinstance(v, list) and all(is_int(t) for t in v)
