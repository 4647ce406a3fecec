"""bench/update_speed.py runs both arms on a tiny model and reports their medians."""

from __future__ import annotations

import json

from bench import update_speed


def test_tiny_run_reports_both_arms(tmp_path) -> None:
    """Each update trains a batch of its own (new lengths, as a job's steps), the same in both arms."""
    out = tmp_path / "update.json"
    update_speed.main(
        ["--prompts", "2", "--group", "3", "--max-tokens", "12", "--repeats", "2", "--out", str(out)]
    )
    report = json.loads(out.read_text())
    assert report["batch"] == 6 and report["speedup"] > 0
    tokens = {}
    for arm in ("batch_order", "length_buckets"):
        medians = report["medians"][arm]
        assert medians["update_s"] > 0 and medians["ref_s"] > 0 and medians["forward_backward_s"] > 0
        assert medians["tokens_per_s_per_gpu"] > 0 and medians["peak_fraction"] is None  # a CPU
        tokens[arm] = [u["update/normaliser_tokens"] for u in report["updates"][arm]]
    assert tokens["batch_order"] == tokens["length_buckets"] and len(set(tokens["batch_order"])) == 2


def test_profile_writes_the_operators_of_one_more_update(tmp_path) -> None:
    out, folder = tmp_path / "update.json", tmp_path / "prof"
    argv = ["--prompts", "2", "--group", "2", "--max-tokens", "8", "--repeats", "1", "--out", str(out)]
    update_speed.main([*argv, "--profile", str(folder)])
    report = json.loads(out.read_text())
    assert report["profile"] == str(folder / "kernels.txt")
    table = (folder / "kernels.txt").read_text()
    assert "aten::mm" in table or "aten::addmm" in table  # the update's products were profiled
    assert json.loads((folder / "trace.json").read_text())["traceEvents"]


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


def test_compile_arms_switch_one_compiled_policy(tmp_path, monkeypatch) -> None:
    """The arms' wiring, not the compiler (tests/unit/test_update_compile.py compiles): torch.compile
    stands aside, so the compiled arm runs the padded batches through the plain function."""
    import torch
    from crucible_trainer.rl.policy import Policy

    calls = []

    def not_compiled(fn, **kwargs):
        def run(*inputs):
            calls.append(kwargs)
            return fn(*inputs)

        return run

    monkeypatch.setattr(torch, "compile", not_compiled)
    forwards = []
    plain = Policy._logprobs

    def logprobs(self, input_ids, attention_mask, position_ids, tail_mask):
        forwards.append((self.run_eager, tail_mask.shape[1]))  # completions of 8 tokens at most
        return plain(self, input_ids, attention_mask, position_ids, tail_mask)

    monkeypatch.setattr(Policy, "_logprobs", logprobs)
    out = tmp_path / "compile.json"
    argv = ["--prompts", "2", "--group", "2", "--max-tokens", "8", "--repeats", "1", "--compare", "compile"]
    update_speed.main([*argv, "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["compile"] == "default" and report["overrides"] == []
    assert set(report["medians"]) == {"eager", "compiled"} and set(report["warmup_s"]) == {
        "eager",
        "compiled",
    }
    assert report["compile_s"] is not None and report["graphs"] == {"after_warmup": 0, "at_end": 0}
    assert calls and all(c == {"mode": "default"} for c in calls)
    # The eager arm's forwards are eager and unpadded; the compiled arm's tails are padded to 64.
    assert {(eager, tail == 64) for eager, tail in forwards} == {(True, False), (False, True)}
