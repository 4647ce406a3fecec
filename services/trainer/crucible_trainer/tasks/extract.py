"""Getting the program out of a model's answer: fenced blocks, `<code>` tags or raw text.

Small instruct models wrap their code in chatter ("Here's a function...", "Example usage:",
explanations after the block) and often add a second block of example calls. `extract_code` picks
the block that defines the function (or the first that defines anything); without fences or tags
it keeps the longest stretch that parses, starting at the first line that looks like code. A block
cut off by `max_tokens` (no closing fence) is kept as it is: the sandbox will call it a syntax error.

`sanitize` then drops top-level statements that are not definitions (example calls, prints,
asserts, `if __name__ == "__main__":` demos), which would otherwise run with the tests and can
fail a correct function. It leaves stdin/stdout programs alone: there, the top level *is* the program.
"""

from __future__ import annotations

import ast
import re
import warnings

_CODE_TAG = re.compile(r"<code>(.*?)(?:</code>|\Z)", re.S)
_FENCE = re.compile(r"^\s*```+\s*([\w+#.-]*)")
_PYTHON_TAGS = {"", "python", "py", "python3", "py3", "pycon", "ipython", "sage"}
_CODE_START = re.compile(
    r"^(?:async\s+def\s|def\s|class\s|import\s|from\s+[\w.]+\s+import\s|@[\w.]+|"
    r"(?:if|for|while|with)\s.*:\s*$|try:|print\(|[A-Za-z_][\w.]*\(|"
    r"[A-Za-z_][\w.\[\]]*\s*(?:,\s*[A-Za-z_]\w*\s*)*=[^=])"
)
_MAX_PARSE_LINES = 400


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The program in `text`: from `<code>` tags, a fenced block, or the raw text, in that order.

    >>> extract_code("Sure!\\n```python\\ndef f():\\n    return 1\\n```\\nThis returns 1.")
    'def f():\\n    return 1'
    """
    tagged = [_strip_fences(m.group(1)) for m in _CODE_TAG.finditer(text)]
    tagged = [t for t in tagged if t.strip()]
    if tagged:
        return _pick(tagged, entry_point).strip("\n")
    blocks = _fenced_blocks(text)
    if blocks:
        return _pick(blocks, entry_point).strip("\n")
    return _raw_code(text)


def extract_refined_code(text: str) -> str:
    """The fixed program of an answer to a refinement prompt: the `<code>` after `</analysis>`.

    Falls back to any code in the answer after the analysis, then in the whole answer.
    """
    _, closed, after = text.partition("</analysis>")
    rest = after if closed else text
    if not closed and "<analysis>" in text:
        # An unclosed analysis: the code, if any, starts at the first tag after it.
        rest = text[text.index("<analysis>") :]
    for part in (rest, text):
        code = extract_code(part)
        if code.strip():
            return code
    return ""


def parse_quietly(code: str) -> ast.Module:
    """`ast.parse` without the warnings model code provokes: sampled programs are full of
    invalid escape sequences, and a GPU run would print them by the hundred (a `SyntaxWarning`
    since Python 3.12, a `DeprecationWarning` before)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(code)


def sanitize(code: str) -> str:
    """Keep imports, functions, classes and assignments at the top level; drop everything else.

    Assignments that call a function the code defines (`result = solve(example)`) are example
    usage too, and go. Code that does not parse is returned unchanged (its syntax error is the truth).

    >>> sanitize("def f(x):\\n    return x\\n\\nprint(f(2))\\ny = f(1)\\nassert y == 2")
    'def f(x):\\n    return x'
    """
    try:
        tree = parse_quietly(code)
    except (SyntaxError, ValueError):
        return code
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }
    lines = source_lines(code)
    kept: list[str] = []
    for node in tree.body:
        if _keep(node, tree, defined):
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            kept.append("\n".join(lines[start - 1 : node.end_lineno]))
    return "\n\n".join(kept)


def source_lines(text: str) -> list[str]:
    """`text`'s lines as Python's parser counts them: at CR LF, LF or CR only. `str.splitlines`
    also breaks at form feeds, U+2028 and a few more, which a program may hold as whitespace or
    inside a string, and its line numbers then no longer match the parser's.

    >>> source_lines("a\\r\\nb\\rc\\n"), source_lines("a\\n\\n")
    (['a', 'b', 'c'], ['a', ''])
    """
    lines = re.split(r"\r\n|\r|\n", text)
    return lines[:-1] if lines[-1] == "" else lines  # as splitlines: no line after the last line end


def defines(code: str, name: str) -> bool:
    """Whether `code` has a `def name(` (or `class name`) at any indentation."""
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", code, flags=re.M) is not None


def _keep(node: ast.stmt, tree: ast.Module, defined: set[str]) -> bool:
    if isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return True
    if isinstance(node, ast.Assign | ast.AnnAssign):
        calls = (n.func for n in ast.walk(node) if isinstance(n, ast.Call))
        return not any(isinstance(f, ast.Name) and f.id in defined for f in calls)
    # A module docstring.
    return node is tree.body[0] and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def _strip_fences(text: str) -> str:
    blocks = _fenced_blocks(text)
    return blocks[0] if blocks else text


def _fenced_blocks(text: str) -> list[str]:
    """Python (or untagged) fenced blocks in order; an unclosed last block runs to the end."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in source_lines(text):
        fence = _FENCE.match(line)
        if fence and current is None:
            current = []
            blocks.append((fence.group(1).lower(), current))
        elif fence and line.strip().strip("`") == "":
            current = None
        elif current is not None:
            current.append(line)
    python = ["\n".join(body) for tag, body in blocks if tag in _PYTHON_TAGS]
    return [b for b in python if b.strip()]


def _pick(blocks: list[str], entry_point: str | None) -> str:
    """The block defining `entry_point`, else the first that defines something, else the longest."""
    if entry_point:
        for block in blocks:
            if defines(block, entry_point):
                return block
    for block in blocks:
        if re.search(r"^\s*(?:async\s+)?(?:def|class)\s", block, flags=re.M):
            return block
    return max(blocks, key=len)


def _raw_code(text: str) -> str:
    """The longest parsable stretch of `text` from its first line that looks like code ("" if none)."""
    lines = source_lines(text.strip("\n"))
    start = next((i for i, line in enumerate(lines) if _CODE_START.match(line)), None)
    if start is None:
        return ""
    lines = lines[start : start + _MAX_PARSE_LINES]
    for end in range(len(lines), 0, -1):
        candidate = "\n".join(lines[:end]).rstrip()
        if not candidate:
            continue
        try:
            parse_quietly(candidate)
        except (SyntaxError, ValueError):
            continue
        return candidate
    # Nothing parses: keep it all, so the sandbox reports the syntax error.
    return "\n".join(lines).rstrip()
