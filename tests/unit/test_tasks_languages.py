"""Tasks in other languages than Python: the stdio adapter's `language`, prompts that ask for it,
and answers taken from its fenced block (never run through Python's sanitizer)."""

from __future__ import annotations

import json

import pytest
from crucible_trainer.tasks import (
    DatasetError,
    DataSpec,
    answer_to_code,
    build_completion_prompt,
    build_messages,
    load_tasks,
)

CPP_FILE = "data/stdio/crucible_stdio_cpp.jsonl"


def test_the_cpp_file_loads_as_cpp_tasks() -> None:
    tasks = load_tasks(DataSpec(dataset="stdio", path=CPP_FILE))
    assert [t.language for t in tasks] == ["cpp"] * 6
    request = tasks[0].reference_request()
    assert request.language == "cpp" and request.tests.kind == "stdio"
    assert "#include" in request.code


def test_prompts_ask_for_the_language() -> None:
    task = load_tasks(DataSpec(dataset="stdio", path=CPP_FILE))[0]
    system, user = build_messages(task)
    assert "C++ programmer" in system["content"] and "```cpp" in system["content"]
    assert "Python" not in system["content"] + user["content"]
    assert "complete C++ program" in user["content"]
    assert build_completion_prompt(task).endswith("```cpp\n")


def test_answers_are_the_languages_fenced_block() -> None:
    task = load_tasks(DataSpec(dataset="stdio", path=CPP_FILE))[0]
    reply = 'Here it is:\n```cpp\n#include <cstdio>\nint main() { puts("3"); }\n```\nIt prints 3.'
    assert answer_to_code(task, reply, chat=True) == '#include <cstdio>\nint main() { puts("3"); }'
    assert answer_to_code(task, "int main() {}\n```\nmore text", chat=False) == "int main() {}"
    assert answer_to_code(task, "   ", chat=True) == ""


def test_call_based_problems_stay_python(tmp_path) -> None:
    row = {
        "question": "q",
        "language": "cpp",
        "input_output": json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [[1]]}),
    }
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match="language"):
        load_tasks(DataSpec(dataset="stdio", path=str(path)))
