"""The package's layering rule (docs/architecture.md), checked on the imports themselves.

Layers, bottom up; a module imports from its own layer or below, never above:
  0  errors, pieces, plan/ (pure NumPy), storage/
  1  tokenizer, formats/, config, configfile, state, batch, metrics, mixreport, job,
     vision/
  2  collective/, pipeline/
  3  delivery, stage_view, peers, watch, runtime, state_relay
  4  loader, observe (metrics records, logs, TensorBoard), the package's __init__
  5  commands/: nothing in the library imports them
plan/ imports nothing outside plan/, errors and pieces (imports under TYPE_CHECKING are for
type names only and are not counted).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import streamload

pytestmark = pytest.mark.core

PACKAGE = Path(streamload.__file__).parent
LAYERS = [("errors", "pieces", "plan", "storage"),
          ("tokenizer", "formats", "config", "configfile", "state", "batch", "metrics",
           "mixreport", "job", "vision"),
          ("collective", "pipeline"),
          ("delivery", "stage_view", "peers", "watch", "runtime", "state_relay"),
          ("loader", "observe", "__init__"),
          ("commands",)]


def layer(top: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if top in names)


def imports(path: Path) -> set[str]:
    """Top-level streamload names that `path` imports at run time."""
    tree = ast.parse(path.read_text())
    module = path.relative_to(PACKAGE).with_suffix("").parts
    package = module[:-1]
    found = set()
    type_only = [n for n in ast.walk(tree) if isinstance(n, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(n.test)]
    skipped = {id(x) for n in type_only for x in ast.walk(n)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                if node.module:
                    target = list(base) + node.module.split(".")
                else:   # "from . import pieces"; "from .. import __version__" (the __init__)
                    target = list(base) or [
                        a.name if (PACKAGE / a.name).exists() or (PACKAGE / f"{a.name}.py").exists()
                        else "__init__" for a in node.names]
            elif node.module and node.module.split(".")[0] == "streamload":
                target = node.module.split(".")[1:]
            else:
                continue
            found.add(target[0] if target else "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "streamload" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_imports_obey_the_layering_rule():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        top = parts[0]
        for target in imports(path):
            if target == top:
                continue
            if layer(target) > layer(top):
                wrong.append(f"{'/'.join(parts)} imports {target}")
            if top == "plan" and target not in ("errors", "pieces"):
                wrong.append(f"{'/'.join(parts)} (pure planning) imports {target}")
    assert not wrong, "\n".join(wrong)


def test_every_module_has_a_layer():
    tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.rglob("*.py")}
    for top in tops - {"__pycache__"}:
        layer(top)   # StopIteration: a new module needs its place in LAYERS
