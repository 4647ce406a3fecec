"""The generator's modules meet through public names: no method borrows another class's `self`
(a mixin typed `self: Engine`), and no module reaches into a private name (`_x`) that another of
the generator's modules defines; the engine and its decode paths have every member of the interface
between them (`decoding.py`). Read from the sources."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import crucible_generator

PACKAGE = Path(crucible_generator.__file__).parent


def _trees() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.glob("*.py"))}


def _private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: its functions, classes and methods, and the attributes
    its methods assign on `self`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            out.add(node.attr)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def _foreign_private_uses(tree: ast.Module) -> set[str]:
    """Private attributes a module reads on something other than `self` or `cls`."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})
    }


def test_no_method_borrows_another_class_self() -> None:
    typed = [
        f"{name}:{cls.name}.{node.name}"
        for name, tree in _trees().items()
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.args.args
        and node.args.args[0].arg == "self"
        and node.args.args[0].annotation is not None
    ]
    assert not typed, f"mixins: methods whose `self` is another class: {typed}"


def test_no_module_reaches_into_another_modules_private_names() -> None:
    trees = _trees()
    defined = {name: _private_names(tree) for name, tree in trees.items()}
    assert "_next_batch" in defined["engine.py"]  # the parser found the definitions
    wrong = {}
    for name, tree in trees.items():
        others = set().union(*(d for other, d in defined.items() if other != name))
        if bad := _foreign_private_uses(tree) & (others - defined[name]):
            wrong[name] = sorted(bad)
    assert not wrong, f"private names used from another module: {wrong}"


def _members(protocol: type) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")}
    return names | set(getattr(protocol, "__annotations__", {}))


def test_the_engine_and_its_decode_paths_keep_to_the_interface() -> None:
    from crucible_generator import batching, decoding, eager, engine

    assert {"record", "take_joiners", "metrics", "peft"} <= _members(decoding.Host)  # read the protocol
    # Attributes the engine sets in `__init__` (`metrics`, `base`, `peft`) are read from its source.
    source = Path(engine.__file__).read_text()
    missing = {
        n for n in _members(decoding.Host) if not hasattr(engine.Engine, n) and f"self.{n} =" not in source
    }
    assert not missing, f"the engine lacks these members of decoding.Host: {sorted(missing)}"
    for path in (eager.EagerPath, batching.ContinuousPath):
        text = Path(inspect.getfile(path)).read_text()
        lacking = {
            n for n in _members(decoding.DecodePath) if not hasattr(path, n) and f"self.{n}" not in text
        }
        assert not lacking, f"{path.__name__} lacks these members of decoding.DecodePath: {sorted(lacking)}"
