"""The rows of a run's JSON-lines files (`metrics.jsonl`, journals), whole rows only.

A run killed while appending a row (or a full disk) leaves half a line, which the next run ends
with a line end of its own and writes after (the trainer's `runtime/sink.py`): every reader skips
such a line rather than failing on it.

>>> rows('{"step": 1}\\n{"step": 2, "lo\\n\\n{"step": 2}\\n[1]\\n')
[{'step': 1}, {'step': 2}]
"""

from __future__ import annotations

import json
from typing import Any


def rows(text: str) -> list[dict[str, Any]]:
    """The JSON object of each line of `text` that holds one; other lines are skipped.
    Lines end at LF (CR LF) only: `json.dumps` escapes the characters `str.splitlines` also
    splits at."""
    out = []
    for line in text.split("\n"):
        line = line.removesuffix("\r")
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out
