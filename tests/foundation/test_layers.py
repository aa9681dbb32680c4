"""The package's layers, enforced: each module imports only from its own layer or those
listed before it, and no private name (`_x`) is imported from another module.

    foundation  _jax_private, _errors, _info, _policy, _scope, _source, _format,
                _measure, _memory, _collectives, _placement, _target
    engine      _engine/         (how `with_hooks` finds and stores residuals)
    policies    policies/        (what to do with each residual)
    tools       _inspect/, _gradcheck, _plan/, _demo, __main__, __init__

A module that fits none of them fails here until it is given a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "residual"

LAYERS = {
    "foundation": {"_jax_private", "_errors", "_info", "_policy", "_scope", "_source",
                   "_format", "_measure", "_memory", "_collectives", "_placement",
                   "_target"},
    "engine": {"_engine"},
    "policies": {"policies"},
    "tools": {"_inspect", "_gradcheck", "_plan", "_demo", "__main__", "__init__"},
}
ORDER = list(LAYERS)


def _layer(module: tuple[str, ...]) -> str:
    """The layer of `module` (its dotted parts below `residual`)."""
    top = module[0] if module else "__init__"
    for layer, members in LAYERS.items():
        if top in members:
            return layer
    raise AssertionError(
        f"`residual.{'.'.join(module)}` belongs to no layer: add it to LAYERS in "
        f"{Path(__file__).name} (and to the package's README)")


def _modules() -> list[tuple[Path, tuple[str, ...]]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found.append((path, parts))
    return found


def _imports(path: Path, parts: tuple[str, ...]):
    """(line, imported module parts, names) of every import of this package in `path`."""
    package = parts[:-1]  # the package a relative import starts from
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "residual":
                base, node.module = (), ".".join(node.module.split(".")[1:]) or None
            else:
                continue
            target = (*base, *node.module.split(".")) if node.module else base
            yield node.lineno, target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "residual":
                    yield node.lineno, tuple(a.name.split(".")[1:]), []


def _is_module(parts: tuple[str, ...]) -> bool:
    where = PACKAGE.joinpath(*parts)
    return where.with_suffix(".py").exists() or where.is_dir()


MODULES = _modules()


@pytest.mark.parametrize(("path", "parts"), MODULES, ids=[".".join(p) for _, p in MODULES])
def test_imports_run_down_the_layers(path, parts):
    mine = _layer(parts)
    wrong = []
    for line, target, names in _imports(path, parts):
        # `from . import policies` names a module: its layer is the module's own; any
        # other name is the package's (`from .. import with_hooks`: `__init__`).
        targets = [(*target, n) if _is_module((*target, n)) else target
                   for n in names] or [target]
        for t in targets:
            theirs = _layer(t)
            if ORDER.index(theirs) > ORDER.index(mine):
                wrong.append(f"line {line}: {mine} imports `{'.'.join(t)}` ({theirs})")
    assert not wrong, f"{path.relative_to(PACKAGE.parent)}: " + "; ".join(wrong)


@pytest.mark.parametrize(("path", "parts"), MODULES, ids=[".".join(p) for _, p in MODULES])
def test_no_private_name_crosses_a_module(path, parts):
    wrong = [f"line {line}: `{name}` from `{'.'.join(target)}`"
             for line, target, names in _imports(path, parts)
             for name in names
             if name.startswith("_") and not _is_module((*target, name))]
    assert not wrong, (f"{path.relative_to(PACKAGE.parent)} imports private names; make "
                       "them public where they live, or move them to a shared module: "
                       + "; ".join(wrong))


def test_every_layer_names_modules_that_exist():
    tops = {p[0] for _, p in MODULES}
    for layer, members in LAYERS.items():
        missing = members - tops
        assert not missing, f"{layer} names modules that do not exist: {sorted(missing)}"
