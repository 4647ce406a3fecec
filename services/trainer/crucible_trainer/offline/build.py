"""Stage `build`: the SFT and DPO datasets from annotated candidates (pure functions).

* `nbest.jsonl`: per problem, up to `n_best` passing candidates, one per distinct program
  (`normalize.normalize_code`), shortest first (fewest completion tokens, ties in sampling
  order: a short correct answer carries less chatter for SFT to imitate) or in sampling order.
  Rows: `prompt`, `completion` (TRL's prompt-completion format), `task_id`, `candidate`, `tokens`.
* `pairs.jsonl`: per problem, up to `max_pairs` pairs of distinct programs where `rejected`
  fails and `chosen` passes every test (`pass_fail`) or a larger fraction of them
  (`more_tests`), by at least `min_margin`. Pairs cover unused chosen and rejected programs
  first, then reuse them, in sampling order (random, since candidates are sampled). Rows:
  `prompt`, `chosen`, `rejected` (TRL's preference format), `task_id`, the two candidates'
  numbers and fractions, `margin`.

Chat models get conversational rows (`prompt` a list of messages, each answer a one-message
list), base models plain text; both are what TRL's trainers and `datasets` read as they are.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crucible_shared.jobs import BuildSpec

from crucible_trainer.offline.artifacts import content_hash
from crucible_trainer.offline.normalize import normalize_code


class EmptyDataset(ValueError):
    """The candidates give the training method nothing to train on."""


@dataclass
class Built:
    nbest: list[dict[str, Any]] = field(default_factory=list)
    pairs: list[dict[str, Any]] = field(default_factory=list)
    per_problem: dict[str, dict[str, int]] = field(default_factory=dict)

    def counts(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        statuses = Counter(r["status"] for r in rows)
        return {
            "problems": len(self.per_problem),
            "candidates": len(rows),
            "passing": sum(1 for r in rows if r["passed"]),
            "problems_with_pass": sum(1 for p in self.per_problem.values() if p["passed"]),
            "nbest": len(self.nbest),
            "pairs": len(self.pairs),
            "problems_in_nbest": sum(1 for p in self.per_problem.values() if p["nbest"]),
            "problems_in_pairs": sum(1 for p in self.per_problem.values() if p["pairs"]),
            "statuses": dict(sorted(statuses.items())),
        }


def build(rows: list[dict[str, Any]], cfg: BuildSpec) -> Built:
    """nbest and pairs rows of every problem, problems in order of first appearance."""
    out = Built()
    for task_id, group in _by_problem(rows).items():
        best = select_nbest(group, cfg.n_best, cfg.order)
        pairs = select_pairs(group, cfg.pairing, cfg.min_margin, cfg.max_pairs)
        out.nbest += [_nbest_row(r, cfg.completion) for r in best]
        out.pairs += [_pair_row(c, r, cfg.completion) for c, r in pairs]
        passed = [r for r in group if r["passed"]]
        out.per_problem[task_id] = {
            "candidates": len(group),
            "passed": len(passed),
            "distinct_passed": len({normalize_code(r["code"]) for r in passed}),
            "nbest": len(best),
            "pairs": len(pairs),
        }
    return out


def require(built: Built, rows: list[dict[str, Any]], method: str, cfg: BuildSpec) -> None:
    """`EmptyDataset` with the counts when `method` (sft | dpo) would get no rows."""
    counts = built.counts(rows)
    statuses = ", ".join(f"{k} {v}" for k, v in counts["statuses"].items())
    seen = f"{counts['candidates']} candidates of {counts['problems']} problems ({statuses})"
    advice = "sample more (generate.k), allow longer answers (generate.max_tokens) or pick easier problems"
    if method == "sft" and not built.nbest:
        raise EmptyDataset(f"build: no passing candidate among {seen}; sft needs at least one: {advice}")
    if method == "dpo" and not built.pairs:
        raise EmptyDataset(
            f"build: no (chosen, rejected) pair from {seen}: {counts['passing']} passing in "
            f"{counts['problems_with_pass']} problems, pairing {cfg.pairing} with min_margin {cfg.min_margin}; "
            f"dpo needs a problem with a better and a failing candidate: {advice}"
        )


def manifest(
    built: Built,
    rows: list[dict[str, Any]],
    cfg: BuildSpec,
    *,
    method: str,
    round: int,
    sources: dict[str, Any],
    inputs: dict[str, Path],
    outputs: dict[str, Path],
) -> dict[str, Any]:
    """`manifest.json`: counts (in total and per problem), where the data came from, the build
    config, and the sha256 of the input and output files (written before the manifest)."""
    return {
        "round": round,
        "counts": built.counts(rows),
        "per_problem": built.per_problem,
        "config": {**cfg.model_dump(mode="json"), "method": method},
        "sources": sources,
        "hashes": {
            "inputs": {name: content_hash(path) for name, path in inputs.items()},
            "outputs": {name: content_hash(path) for name, path in outputs.items()},
        },
    }


def select_nbest(rows: list[dict[str, Any]], n: int, order: str) -> list[dict[str, Any]]:
    """Up to `n` passing candidates of one problem, one per distinct program."""
    passing = [r for r in rows if r["passed"]]
    if order == "shortest":
        passing.sort(key=lambda r: (_length(r), r["index"]))
    else:
        passing.sort(key=lambda r: r["index"])
    return _distinct(passing)[:n]


def select_pairs(
    rows: list[dict[str, Any]], strategy: str, min_margin: float, max_pairs: int
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Up to `max_pairs` (chosen, rejected) pairs of one problem (see the module docstring)."""
    distinct = _distinct(sorted(rows, key=lambda r: r["index"]))
    rejected = [r for r in distinct if not r["passed"]]
    if strategy == "pass_fail":
        chosen = [r for r in distinct if r["passed"]]
    else:
        chosen = [r for r in distinct if _fraction(r) > 0]
    options = [
        (c, r)
        for c in chosen
        for r in rejected
        if _fraction(c) - _fraction(r) >= min_margin and _fraction(c) > _fraction(r)
    ]
    picked: list[tuple[dict[str, Any], dict[str, Any]]] = []
    uses: Counter[int] = Counter()
    while options and len(picked) < max_pairs:
        # The least-used programs first; `min` keeps sampling order among equals.
        best = min(options, key=lambda p: uses[id(p[0])] + uses[id(p[1])])
        options.remove(best)
        picked.append(best)
        uses[id(best[0])] += 1
        uses[id(best[1])] += 1
    return picked


def _by_problem(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["task_id"], []).append(row)
    return groups


def _distinct(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first row of each distinct program (rows without code: of each distinct answer)."""
    seen, out = set(), []
    for row in rows:
        key = normalize_code(row["code"]) if row["code"].strip() else "\0" + row["completion"].strip()
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def _length(row: dict[str, Any]) -> int:
    return row.get("tokens") or len(row["completion"])


def _fraction(row: dict[str, Any]) -> float:
    return 1.0 if row["passed"] else float(row.get("fraction") or 0.0)


def _answer(row: dict[str, Any], mode: str) -> Any:
    chat = isinstance(row["prompt"], list)
    text = row["completion"]
    if mode == "code" and row["code"].strip():
        text = f"```python\n{row['code'].strip()}\n```" if chat else row["code"]
    return [{"role": "assistant", "content": text}] if chat else text


def _nbest_row(row: dict[str, Any], mode: str) -> dict[str, Any]:
    return {
        "prompt": row["prompt"],
        "completion": _answer(row, mode),
        "task_id": row["task_id"],
        "candidate": row["index"],
        "tokens": row.get("tokens") or 0,
    }


def _pair_row(chosen: dict[str, Any], rejected: dict[str, Any], mode: str) -> dict[str, Any]:
    return {
        "prompt": chosen["prompt"],
        "chosen": _answer(chosen, mode),
        "rejected": _answer(rejected, mode),
        "task_id": chosen["task_id"],
        "chosen_candidate": chosen["index"],
        "rejected_candidate": rejected["index"],
        "chosen_fraction": _fraction(chosen),
        "rejected_fraction": _fraction(rejected),
        "margin": round(_fraction(chosen) - _fraction(rejected), 6),
    }
