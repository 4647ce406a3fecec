"""How many greedy answers of an evaluation report are functions that only return a literal.

A reward that pays for a fraction of the tests also pays for `return True`: it passes every
assert whose expected value happens to be True. A policy trained on such a reward can learn to
hard-code answers instead of computing them; this counts how often it did.

    python bench/literal_answers.py runs/.../eval/before/report.json runs/.../eval/after/report.json
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path


def _literal(node: ast.expr) -> bool:
    """A constant, or a container (or a negation) of constants: nothing computed from the input."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _literal(k) for k in node.keys) and all(_literal(v) for v in node.values)
    return False


def literal_only(code: str | None) -> bool:
    """Every function the program defines is one `return <literal>` statement."""
    try:
        tree = ast.parse(code or "")
    except SyntaxError:
        return False
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    return bool(functions) and all(
        len(f.body) == 1
        and isinstance(f.body[0], ast.Return)
        and f.body[0].value is not None
        and _literal(f.body[0].value)
        for f in functions
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.reports:
        problems = json.loads(path.read_text())["problems"]
        greedy = [p["greedy"] for p in problems if p.get("greedy")]
        literal = [g for g in greedy if literal_only(g.get("code"))]
        passed = sum(g["status"] == "passed" for g in literal)
        print(
            f"{path}: {len(literal)}/{len(greedy)} greedy answers only return a literal ({passed} of them pass)"
        )


if __name__ == "__main__":
    main()
