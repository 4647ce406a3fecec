"""The vendored MBPP file is the one we think it is."""

import hashlib
import json
from pathlib import Path

MBPP = Path(__file__).resolve().parents[2] / "data" / "mbpp.jsonl"
SHA256 = "0b7004a79cd62d9ec7ecdd5a6e5f0ef1210ff00b286df3c5d5b57bf38c58e19a"


def test_mbpp_checksum() -> None:
    assert hashlib.sha256(MBPP.read_bytes()).hexdigest() == SHA256


def test_mbpp_shape() -> None:
    rows = [json.loads(line) for line in MBPP.open()]
    assert len(rows) == 974
    assert [r["task_id"] for r in rows] == list(range(1, 975))
    assert all(r["test_list"] for r in rows)
