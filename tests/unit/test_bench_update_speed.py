"""bench/update_speed.py runs both arms on a tiny model and reports their medians."""

from __future__ import annotations

import json

from bench import update_speed


def test_tiny_run_reports_both_arms(tmp_path) -> None:
    out = tmp_path / "update.json"
    update_speed.main(
        ["--prompts", "2", "--group", "3", "--max-tokens", "12", "--repeats", "1", "--out", str(out)]
    )
    report = json.loads(out.read_text())
    assert report["batch"] == 6 and report["speedup"] > 0
    for arm in ("batch_order", "length_buckets"):
        medians = report["medians"][arm]
        assert medians["update_s"] > 0 and medians["ref_s"] > 0 and medians["forward_backward_s"] > 0
        assert medians["tokens_per_s_per_gpu"] > 0 and medians["peak_fraction"] is None  # a CPU
        assert len(report["updates"][arm]) == 1
