"""JSONL readers with line-numbered errors.

- perplexity records (the challenge's format): {"context_ids": [int], "target_ids": [int]} per line;
  the targets are scored given the context.
- prompt files: {"prompt_ids": [int]} (or "ids" / "context_ids") or {"text": str} (or "prompt").
Blank lines are skipped; anything else that is not such an object names its file and line.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..checks import is_int_list


def _lines(path: Path):
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"JSONL file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"JSONL path {path} is not a regular file")
    with path.open("r", encoding="utf-8", errors="strict") as f:
        try:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        obj = json.loads(line.rstrip("\r\n"))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{n}: not valid JSON ({err.msg} at column {err.colno})") from None
                    if not isinstance(obj, dict):
                        raise ValueError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
                    yield n, obj
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err})") from None


def _ids(path, n, obj, key, vocab_size=None, allow_empty=False) -> list[int]:
    v = obj[key]
    if not is_int_list(v):
        raise ValueError(f"{path}:{n}: {key!r} must be a list of integers")
    if not v and not allow_empty:
        raise ValueError(f"{path}:{n}: {key!r} is empty")
    if vocab_size is not None:
        bad = [t for t in v if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{path}:{n}: {key!r} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    return v


def read_ppl_jsonl(path, vocab_size: int | None = None) -> list[tuple[list[int], list[int]]]:
    """-> [(context_ids, target_ids)], every line checked."""
    out = []
    for n, obj in _lines(path):
        missing = [k for k in ("context_ids", "target_ids") if k not in obj]
        if missing:
            raise ValueError(f"{path}:{n}: missing key(s) {', '.join(missing)} "
                             "(each line is {\"context_ids\": [...], \"target_ids\": [...]})")
        out.append((_ids(path, n, obj, "context_ids", vocab_size), _ids(path, n, obj, "target_ids", vocab_size)))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


_ID_KEYS = ("prompt_ids", "ids", "context_ids")
_TEXT_KEYS = ("text", "prompt")


def read_prompts_jsonl(path) -> list[dict]:
    """-> [{"line": n, "ids": [int] | None, "text": str | None}]."""
    out = []
    for n, obj in _lines(path):
        key = next((k for k in _ID_KEYS if k in obj), None)
        if key is not None:
            out.append({"line": n, "ids": _ids(path, n, obj, key), "text": None})
            continue
        key = next((k for k in _TEXT_KEYS if k in obj), None)
        if key is None or not isinstance(obj[key], str) or not obj[key]:
            raise ValueError(f"{path}:{n}: expected a non-empty {' / '.join(_ID_KEYS)} id list "
                             f"or {' / '.join(_TEXT_KEYS)} string")
        out.append({"line": n, "ids": None, "text": obj[key]})
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
