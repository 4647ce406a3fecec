"""The offline pipeline's data stages as pure functions: dedup, nbest, pairing, the manifest,
the empty-dataset errors, the analysis, and the files `datasets` reads as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from crucible_shared.jobs import BuildSpec
from crucible_trainer.offline import analysis, artifacts, build, normalize
from crucible_trainer.offline.build import EmptyDataset, select_nbest, select_pairs

PROMPT = [{"role": "system", "content": "sys"}, {"role": "user", "content": "write add"}]


def cand(
    index: int, code: str, *, passed: bool, fraction: float | None = None, tokens: int = 10, task: str = "t1"
):
    """An annotated candidate row as the annotate stage writes it."""
    return {
        "task_id": task,
        "index": index,
        "round": 1,
        "prompt": PROMPT,
        "completion": f"```python\n{code}\n```" if code else "I cannot do that.",
        "code": code,
        "tokens": tokens,
        "finish_reason": "stop",
        "status": "passed" if passed else ("failed" if code else "no_code"),
        "passed": passed,
        "tests_passed": 3 if passed else round(3 * (fraction or 0)),
        "tests_total": 3,
        "fraction": 1.0 if passed else (fraction or 0.0),
        "message": "",
        "verdicts": [],
    }


GOOD = "def add(a, b):\n    return a + b"
GOOD_REFORMATTED = "def add(a,b):\n  # the sum\n  return a+b\n"
GOOD_OTHER = "def add(a, b):\n    return sum([a, b])"
BAD = "def add(a, b):\n    return a - b"
HALF = "def add(a, b):\n    return a + b if a else 0"


def test_duplicates_differ_only_in_comments_and_spacing() -> None:
    assert normalize.normalize_code(GOOD) == normalize.normalize_code(GOOD_REFORMATTED)
    assert normalize.normalize_code(GOOD) != normalize.normalize_code(GOOD_OTHER)
    # Indentation is part of a Python program: the same tokens at another depth are another program.
    nested = "for x in y:\n    f(x)\n    g(x)"
    flat = "for x in y:\n    f(x)\ng(x)"
    assert normalize.normalize_code(nested) != normalize.normalize_code(flat)
    # Code that does not tokenize still gets a key.
    assert normalize.normalize_code('x = """open') == normalize.normalize_code('x  =  """open')


def test_nbest_keeps_distinct_passing_programs_shortest_first() -> None:
    rows = [
        cand(0, GOOD_OTHER, passed=True, tokens=30),
        cand(1, BAD, passed=False, tokens=5),
        cand(2, GOOD_REFORMATTED, passed=True, tokens=25),
        cand(3, GOOD, passed=True, tokens=12),
    ]
    chosen = select_nbest(rows, 4, "shortest")
    assert [r["index"] for r in chosen] == [3, 0]  # 2 duplicates 3 (after it by length); 1 fails
    assert [r["index"] for r in select_nbest(rows, 1, "shortest")] == [3]
    assert [r["index"] for r in select_nbest(rows, 4, "first")] == [0, 2]


def test_pass_fail_pairs_a_passing_with_a_failing_program() -> None:
    rows = [
        cand(0, GOOD, passed=True),
        cand(1, BAD, passed=False),
        cand(2, GOOD_REFORMATTED, passed=True),  # duplicate of 0: not paired again
        cand(3, "", passed=False),  # no code: still a rejected answer
        cand(4, HALF, passed=False, fraction=2 / 3),
    ]
    pairs = select_pairs(rows, "pass_fail", 0.0, 10)
    assert [(c["index"], r["index"]) for c, r in pairs] == [(0, 1), (0, 3), (0, 4)]
    assert all(c["passed"] and not r["passed"] for c, r in pairs)
    # min_margin drops the near miss (1 - 2/3 < 0.5).
    assert [(c["index"], r["index"]) for c, r in select_pairs(rows, "pass_fail", 0.5, 10)] == [(0, 1), (0, 3)]


def test_more_tests_pairs_by_fraction_passed() -> None:
    rows = [cand(0, HALF, passed=False, fraction=2 / 3), cand(1, BAD, passed=False, fraction=1 / 3)]
    assert select_pairs(rows, "pass_fail", 0.0, 4) == []  # nothing passes every test
    (pair,) = select_pairs(rows, "more_tests", 0.0, 4)
    assert (pair[0]["index"], pair[1]["index"]) == (0, 1)
    assert select_pairs(rows, "more_tests", 0.5, 4) == []
    # Equal fractions are no preference.
    assert select_pairs([cand(0, BAD, passed=False), cand(1, "", passed=False)], "more_tests", 0.0, 4) == []


def test_pairs_cover_distinct_programs_before_reusing_them() -> None:
    rows = [
        cand(0, GOOD, passed=True),
        cand(1, GOOD_OTHER, passed=True),
        cand(2, BAD, passed=False),
        cand(3, "def add(a, b):\n    return a * b", passed=False),
    ]
    two = [(c["index"], r["index"]) for c, r in select_pairs(rows, "pass_fail", 0.0, 2)]
    assert two == [(0, 2), (1, 3)]  # every program once, not (0, 2), (0, 3)
    four = select_pairs(rows, "pass_fail", 0.0, 10)
    assert len(four) == 4 and len({(c["index"], r["index"]) for c, r in four}) == 4


def test_build_rows_are_trl_formats_with_counts() -> None:
    rows = [
        cand(0, GOOD, passed=True),
        cand(1, BAD, passed=False),
        cand(0, BAD, passed=False, task="t2"),
        cand(1, "", passed=False, task="t2"),
    ]
    built = build.build(rows, BuildSpec(max_pairs=1))
    (best,) = built.nbest
    assert best["prompt"] == PROMPT and best["completion"] == [
        {"role": "assistant", "content": rows[0]["completion"]}
    ]
    (pair,) = built.pairs
    assert set(pair) >= {"prompt", "chosen", "rejected", "task_id", "margin"}
    assert pair["chosen"][0]["content"] == rows[0]["completion"] and pair["margin"] == 1.0
    assert built.per_problem == {
        "t1": {"candidates": 2, "passed": 1, "distinct_passed": 1, "nbest": 1, "pairs": 1},
        "t2": {"candidates": 2, "passed": 0, "distinct_passed": 0, "nbest": 0, "pairs": 0},
    }
    counts = built.counts(rows)
    assert counts["problems_with_pass"] == 1 and counts["statuses"] == {
        "failed": 2,
        "no_code": 1,
        "passed": 1,
    }
    # `completion: code` trains on the program alone; base models (text prompts) get plain strings.
    code_only = build.build(rows, BuildSpec(completion="code")).nbest[0]["completion"][0]["content"]
    assert code_only == f"```python\n{GOOD}\n```"
    text = [{**r, "prompt": '"""\nwrite add\n"""\n'} for r in rows]
    assert build.build(text, BuildSpec(completion="code")).nbest[0]["completion"] == GOOD


def test_empty_datasets_fail_with_the_counts() -> None:
    rows = [cand(0, BAD, passed=False), cand(1, "", passed=False), cand(0, BAD, passed=False, task="t2")]
    built = build.build(rows, BuildSpec())
    with pytest.raises(
        EmptyDataset, match=r"no passing candidate among 3 candidates of 2 problems \(failed 2, no_code 1\)"
    ):
        build.require(built, rows, "sft", BuildSpec())
    with pytest.raises(
        EmptyDataset, match=r"no \(chosen, rejected\) pair from 3 candidates .* 0 passing in 0 problems"
    ):
        build.require(built, rows, "dpo", BuildSpec())
    passing_only = [cand(0, GOOD, passed=True)]
    build.require(build.build(passing_only, BuildSpec()), passing_only, "sft", BuildSpec())
    with pytest.raises(EmptyDataset, match="1 passing in 1 problems"):
        build.require(build.build(passing_only, BuildSpec()), passing_only, "dpo", BuildSpec())


def test_manifest_holds_counts_sources_config_and_hashes(tmp_path: Path) -> None:
    rows = [cand(0, GOOD, passed=True), cand(1, BAD, passed=False)]
    source = artifacts.write_rows(tmp_path / "candidates_annotated.jsonl", rows)
    built = build.build(rows, BuildSpec())
    nbest = artifacts.write_rows(tmp_path / "nbest.jsonl", built.nbest)
    pairs = artifacts.write_rows(tmp_path / "pairs.jsonl", built.pairs)
    manifest = build.manifest(
        built,
        rows,
        BuildSpec(),
        method="dpo",
        round=1,
        sources={"data": "jsonl/all"},
        inputs={"candidates_annotated.jsonl": source},
        outputs={"nbest.jsonl": nbest, "pairs.jsonl": pairs},
    )
    assert manifest["counts"]["nbest"] == 1 and manifest["counts"]["pairs"] == 1
    assert manifest["per_problem"]["t1"]["passed"] == 1
    assert manifest["config"]["method"] == "dpo" and manifest["config"]["pairing"] == "pass_fail"
    assert manifest["hashes"]["outputs"]["pairs.jsonl"] == artifacts.content_hash(pairs)
    assert manifest["hashes"]["inputs"]["candidates_annotated.jsonl"] == artifacts.content_hash(source)
    json.dumps(manifest)  # JSON as it is


def test_datasets_reads_the_files_as_they_are(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [
        cand(0, GOOD, passed=True),
        cand(1, BAD, passed=False),
        cand(2, GOOD_OTHER, passed=True, tokens=40),
    ]
    built = build.build(rows, BuildSpec())
    artifacts.write_rows(tmp_path / "nbest.jsonl", built.nbest)
    artifacts.write_rows(tmp_path / "pairs.jsonl", built.pairs)
    for name, columns, count in (
        ("nbest", {"prompt", "completion"}, 2),
        ("pairs", {"prompt", "chosen", "rejected"}, 2),
    ):
        ds = datasets.load_dataset(
            "json",
            data_files=str(tmp_path / f"{name}.jsonl"),
            split="train",
            cache_dir=str(tmp_path / "cache"),
        )
        assert columns <= set(ds.column_names) and len(ds) == count
        assert ds[0]["prompt"] == PROMPT


def test_analysis_of_a_round() -> None:
    rows = [
        cand(0, GOOD, passed=True, tokens=10),
        cand(1, GOOD_REFORMATTED, passed=True, tokens=20),
        cand(0, BAD, passed=False, tokens=30, task="t2"),
        cand(1, GOOD_OTHER, passed=False, tokens=40, task="t2"),
    ]
    a = analysis.analyze_round(rows)
    assert a["problems"] == 2 and a["pass_rate"] == 0.5
    assert a["pass_rate_distribution"]["1"] == 1 and a["pass_rate_distribution"]["0"] == 1
    assert a["distinct_programs_per_problem"]["mean"] == 1.5  # t1's two answers are one program
    assert a["mean_pairwise_similarity"] is not None and 0 < a["mean_pairwise_similarity"] <= 1
    assert a["tokens"]["passing"]["mean"] == 15 and a["tokens"]["failing"]["mean"] == 35
    text = analysis.render_markdown({"rounds": {"round-1": a}})
    assert "| pass rate | 50.0% |" in text and "distinct programs / problem | 1.50" in text
