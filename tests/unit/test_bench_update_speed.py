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


def test_precision_arms_on_a_bf16_tiny_model(tmp_path) -> None:
    out = tmp_path / "precision.json"
    argv = ["--prompts", "2", "--group", "2", "--min-tokens", "8", "--max-tokens", "8", "--repeats", "1"]
    argv += ["--compare", "precision"]
    update_speed.main([*argv, "--dtype", "bfloat16", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["compare"] == "precision" and report["dtype"] == "bfloat16"
    assert report["completion_tokens_mean"] == 8  # every completion of one length
    assert set(report["medians"]) == {"peft_casting", "mixed"} and report["speedup"] > 0
    for arm in ("peft_casting", "mixed"):
        assert report["medians"][arm]["forward_backward_s"] > 0
