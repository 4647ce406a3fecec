"""Dataset adapters and `DataSpec` selection: MBPP, HumanEval, stdin/stdout (TACO/APPS) and custom JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from crucible_shared.sandbox import AssertTests, CheckTests, StdioTests
from crucible_trainer.tasks import DatasetError, DataSpec, Task, load_tasks
from crucible_trainer.tasks.mbpp import KNOWN_BAD_REFERENCES
from pydantic import ValidationError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --- MBPP ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "count", "first", "last"),
    [
        ("prompt", 10, 1, 10),
        ("test", 500, 11, 510),
        ("validation", 90, 511, 600),
        ("train", 374, 601, 974),
        ("all", 974, 1, 974),
    ],
)
def test_mbpp_standard_splits(split: str, count: int, first: int, last: int) -> None:
    tasks = load_tasks(DataSpec(dataset="mbpp", split=split))
    assert len(tasks) == count
    assert (tasks[0].task_id, tasks[-1].task_id) == (f"MBPP/{first}", f"MBPP/{last}")


def test_mbpp_default_split_is_test() -> None:
    assert len(load_tasks(DataSpec())) == 500


def test_mbpp_task_fields() -> None:
    task = load_tasks(DataSpec(ids=[11]))[0]
    assert task.dataset == "mbpp"
    assert task.entry_point == "remove_Occ"
    assert task.shown_test == 'assert remove_Occ("hello","l") == "heo"'
    assert isinstance(task.tests, AssertTests)
    # Three test_list asserts and the two challenge_test_list ones.
    assert len(task.tests.asserts) == 5
    assert task.shown_test == task.tests.asserts[0]
    assert task.metadata["split"] == "test"


def test_mbpp_challenge_tests_can_be_left_out() -> None:
    assert len(load_tasks(DataSpec(ids=[11], challenge_tests=False))[0].tests.asserts) == 3


def test_mbpp_setup_code_is_kept() -> None:
    task = load_tasks(DataSpec(ids=[367]))[0]
    assert "root = Node(1)" in task.tests.setup


def test_mbpp_every_task_knows_its_function() -> None:
    tasks = load_tasks(DataSpec(split="all"))
    assert all(t.entry_point and f"def {t.entry_point}" in t.reference for t in tasks)
    assert {t.metadata["number"] for t in tasks if t.metadata["known_bad_reference"]} == KNOWN_BAD_REFERENCES


def test_mbpp_selection_by_ids_range_and_limit() -> None:
    assert [t.task_id for t in load_tasks(DataSpec(ids=[602, "MBPP/601", "11"]))] == [
        "MBPP/602",
        "MBPP/601",
        "MBPP/11",
    ]
    assert [t.metadata["number"] for t in load_tasks(DataSpec(id_range=(601, 605)))] == [
        601,
        602,
        603,
        604,
        605,
    ]
    assert len(load_tasks(DataSpec(split="train", limit=30))) == 30
    assert load_tasks(DataSpec(split="train", limit=3))[0].task_id == "MBPP/601"


def test_mbpp_random_subset_is_seeded() -> None:
    a = load_tasks(DataSpec(split="train", shuffle=True, limit=30, seed=7))
    b = load_tasks(DataSpec(split="train", shuffle=True, limit=30, seed=7))
    c = load_tasks(DataSpec(split="train", shuffle=True, limit=30, seed=8))
    assert [t.task_id for t in a] == [t.task_id for t in b] != [t.task_id for t in c]
    assert all(601 <= t.metadata["number"] <= 974 for t in a)


def test_mbpp_ids_outside_the_split_are_named() -> None:
    with pytest.raises(ValidationError, match=r"ids\.1: 601 is not a task of MBPP's test split"):
        DataSpec(split="test", ids=[11, 601])  # refused with the spec, before any loading
    # A spec built without validation (an older record) still meets the loader's check.
    with pytest.raises(DatasetError, match="601"):
        load_tasks(DataSpec.model_construct(**{**DataSpec().__dict__, "split": "test", "ids": [11, 601]}))


def test_mbpp_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"nowhere\.jsonl"):
        load_tasks(DataSpec(path=str(tmp_path / "nowhere.jsonl")))


def test_mbpp_bad_line_is_named(tmp_path: Path) -> None:
    good = {
        "task_id": 1,
        "text": "t",
        "code": "c",
        "test_list": ["assert f() == 1"],
        "test_setup_code": "",
        "challenge_test_list": [],
    }
    bad = {k: v for k, v in good.items() if k != "test_list"} | {"task_id": 2}
    path = write_jsonl(tmp_path / "mbpp.jsonl", [good, bad])
    with pytest.raises(DatasetError, match=r"mbpp.jsonl:2: field 'test_list'"):
        load_tasks(DataSpec(path=str(path), split="all"))


# --- HumanEval -----------------------------------------------------------------------------------


def test_humaneval_loads_all_164() -> None:
    tasks = load_tasks(DataSpec(dataset="humaneval"))
    assert len(tasks) == 164
    assert tasks[0].task_id == "HumanEval/0"
    assert all(isinstance(t.tests, CheckTests) and t.tests.entry_point == t.entry_point for t in tasks)
    assert all(t.prompt_is_code and t.reference.startswith(t.prompt) for t in tasks)


def test_humaneval_preamble_holds_imports_and_helpers() -> None:
    first, tenth = load_tasks(DataSpec(dataset="humaneval", ids=[0, 10]))
    assert first.preamble.strip() == "from typing import List"
    assert "def is_palindrome" in tenth.preamble
    # A chat answer without the helper still gets it; the reference already starts with it.
    program = tenth.program("def make_palindrome(string):\n    return string")
    assert program.index("def is_palindrome") < program.index("def make_palindrome")
    assert tenth.program(tenth.reference) == tenth.reference


def test_humaneval_selection() -> None:
    assert [t.task_id for t in load_tasks(DataSpec(dataset="humaneval", id_range=(3, 5)))] == [
        "HumanEval/3",
        "HumanEval/4",
        "HumanEval/5",
    ]
    with pytest.raises(DatasetError, match="HumanEval/999"):
        load_tasks(DataSpec(dataset="humaneval", ids=["HumanEval/999"]))


# --- stdin/stdout (TACO / APPS) --------------------------------------------------------------------


def test_stdio_taco_form(tmp_path: Path) -> None:
    rows = [
        {
            "question": "Read two integers and print their sum.",
            "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}),
            "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)"]),
            "difficulty": "EASY",
        },
        {
            "question": "Echo the lines.",
            "input_output": {"inputs": [["a", "b"]], "outputs": [["a", "b"]]},
            "id": "echo",
        },
    ]
    path = write_jsonl(tmp_path / "taco.jsonl", rows)
    first, second = load_tasks(DataSpec(dataset="stdio", path=str(path)))
    assert isinstance(first.tests, StdioTests)
    assert [(c.input, c.output) for c in first.tests.cases] == [("1 2\n", "3\n"), ("3 4\n", "7\n")]
    assert first.reference.startswith("a, b = map")
    assert first.metadata["difficulty"] == "EASY"
    assert first.task_id == "taco/1"
    assert second.task_id == "echo"
    assert second.tests.cases[0].input == "a\nb\n"


def test_stdio_call_based_apps_form(tmp_path: Path) -> None:
    row = {
        "question": "Return the sum of a list.",
        "input_output": {"fn_name": "total", "inputs": [[[1, 2, 3]], [[]]], "outputs": [[6], [0]]},
        "starter_code": "class Solution:\n    def total(self, xs):\n        ",
    }
    path = write_jsonl(tmp_path / "apps.jsonl", [row])
    (task,) = load_tasks(DataSpec(dataset="stdio", path=str(path)))
    assert isinstance(task.tests, AssertTests)
    assert task.tests.asserts == ["assert total([1, 2, 3]) == 6", "assert total([]) == 0"]
    assert "Solution().total" in task.tests.setup
    assert task.entry_point == "total"


def test_stdio_max_cases(tmp_path: Path) -> None:
    row = {"question": "q", "input_output": {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}}
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    (task,) = load_tasks(DataSpec(dataset="stdio", path=str(path), max_cases=2))
    assert len(task.tests.cases) == 2


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"input_output": {"inputs": ["1"], "outputs": ["1"]}}, r"p.jsonl:2: field 'question'"),
        ({"question": "q"}, r"p.jsonl:2: field 'input_output': missing"),
        ({"question": "q", "input_output": "{not json"}, r"field 'input_output': not valid JSON"),
        ({"question": "q", "input_output": {"inputs": ["1"], "outputs": []}}, r"1 inputs but 0 outputs"),
        (
            {"question": "q", "input_output": {"inputs": [3], "outputs": ["3"]}},
            r"field 'input_output.inputs.0'",
        ),
        ({"question": "q", "input_output": {"fn_name": "f", "inputs": ["x"], "outputs": [1]}}, r"argument"),
    ],
)
def test_stdio_malformed_line_names_file_line_and_field(tmp_path: Path, row: dict, match: str) -> None:
    ok = {"question": "q", "input_output": {"inputs": ["1"], "outputs": ["1"]}}
    path = write_jsonl(tmp_path / "p.jsonl", [ok, row])
    with pytest.raises(DatasetError, match=match):
        load_tasks(DataSpec(dataset="stdio", path=str(path)))


# --- custom JSONL ----------------------------------------------------------------------------------


def test_custom_jsonl_all_three_test_forms(tmp_path: Path) -> None:
    rows = [
        {
            "task_id": "add",
            "prompt": "Write add(a, b).",
            "tests": ["assert add(2, 2) == 4"],
            "entry_point": "add",
        },
        {
            "prompt": "def inc(x):\n",
            "tests": {
                "kind": "check",
                "check": "def check(candidate):\n    assert candidate(1) == 2",
                "entry_point": "inc",
            },
            "prompt_is_code": True,
        },
        {
            "prompt": "Print the input doubled.",
            "tests": {"kind": "stdio", "cases": [{"input": "2\n", "output": "4\n"}]},
        },
    ]
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    tasks = load_tasks(DataSpec(dataset="jsonl", path=str(path)))
    assert [t.task_id for t in tasks] == ["add", "mine/2", "mine/3"]
    assert [t.tests.kind for t in tasks] == ["asserts", "check", "stdio"]
    assert all(t.dataset == "jsonl" for t in tasks)
    assert load_tasks(DataSpec(dataset="jsonl", path=str(path), ids=["add"]))[0].entry_point == "add"


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "p"}', r"mine.jsonl:2: field 'tests': Field required"),
        (
            '{"prompt": "p", "tests": {"kind": "check", "check": "def check(c): pass"}}',
            r"mine.jsonl:2: field 'tests.entry_point'",
        ),
        ('{"prompt": "p", "tests": {"kind": "asserts", "asserts": []}}', r"field 'tests.asserts'"),
        ('{"prompt": "p", "tests": ["assert 1"], "tset": 1}', r"field 'tset': Extra inputs"),
        ('{"prompt": "p", "tests": {"kind": "shell"}}', r"field 'tests'"),
        ("{not json", r"mine.jsonl:2: not valid JSON"),
        ("[1, 2]", r"mine.jsonl:2: expected a JSON object"),
        (
            '{"task_id": "a", "prompt": "p", "tests": ["assert 1"]}',
            r"mine.jsonl:2: field 'task_id': duplicate",
        ),
    ],
)
def test_custom_jsonl_malformed_line_names_file_line_and_field(tmp_path: Path, line: str, match: str) -> None:
    path = write_jsonl(
        tmp_path / "mine.jsonl", ['{"task_id": "a", "prompt": "p", "tests": ["assert 1"]}', line]
    )
    with pytest.raises(DatasetError, match=match):
        load_tasks(DataSpec(dataset="jsonl", path=str(path)))


# --- DataSpec ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"dataset": "stdio"}, "path"),
        ({"dataset": "jsonl"}, "path"),
        ({"dataset": "humaneval", "split": "validation"}, "split"),
        ({"dataset": "stdio", "path": "x.jsonl", "split": "train"}, "split"),
        ({"ids": [1], "id_range": (1, 2)}, "id_range"),
        ({"id_range": (5, 1)}, "id_range"),
        ({"limit": 0}, "limit"),
        ({"dataset": "apps"}, "dataset"),
        ({"split": "dev"}, "split"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_dataspec_rejects_bad_fields(fields: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        DataSpec(**fields)


def test_dataspec_round_trips_through_json() -> None:
    spec = DataSpec(dataset="mbpp", split="train", id_range=(601, 630), shuffle=True, seed=3, limit=10)
    again = DataSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert [t.task_id for t in load_tasks(again)] == [t.task_id for t in load_tasks(spec)]


def test_run_request_carries_tests_and_limits() -> None:
    from crucible_shared.sandbox import Limits

    task: Task = load_tasks(DataSpec(ids=[11]))[0]
    request = task.run_request("def remove_Occ(s, ch):\n    return s", Limits(wall_time_s=3))
    assert request.tests == task.tests
    assert request.limits.wall_time_s == 3
    assert task.reference_request().code == task.reference
