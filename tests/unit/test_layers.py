"""The package's layering, read from its imports (module level, inside functions and under
TYPE_CHECKING alike): every import goes to a lower layer, and no units import each other in a
circle. The README's engine map shows the same table."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import tokenmill

PACKAGE_DIR = Path(tokenmill.__file__).parent

# Lowest first. A unit is a subpackage or a top-level module of `tokenmill`; it may import
# units of a lower layer only (never one of its own layer, never a higher one).
LAYERS: list[tuple[str, ...]] = [
    ("utils", "csrc"),
    ("presets", "sampling_params", "lora_request", "pdl"),
    ("config", "outputs", "chat_template", "gguf_tokenizer"),
    ("request", "metrics", "tokenizer"),
    ("detokenizer", "core", "distributed", "structured"),
    ("attention",),
    ("models",),
    ("quant", "lora"),
    ("model_loader",),
    ("runner",),
    ("spec_decode", "executor"),
    ("engine",),
    ("api",),
    ("retrieval", "ops"),
    ("server", "batch", "stream", "chat"),
    ("bench",),
    ("cli",),
    ("__main__",),
]

# Modules that only their own subpackage may import: the outside uses the public surface.
PRIVATE_MODULES = {"tokenmill.engine.core": "tokenmill.engine"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = ("tokenmill", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imported(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The tokenmill modules that ``module`` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin
                     for a in node.names]
        for name in names:
            if name.split(".")[0] != "tokenmill":
                continue
            while name not in mods and "." in name:
                name = name.rsplit(".", 1)[0]
            found.add(name)
    return found


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package root, the public facade


def _import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imported(m, p, mods) for m, p in mods.items()}


def _layer_of() -> dict[str, int]:
    return {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def test_every_unit_has_a_layer() -> None:
    layer = _layer_of()
    units = {_unit(m) for m in _modules()} - {None}
    assert sorted(units - set(layer)) == [], "add these units to LAYERS (and the README's map)"
    assert sorted(set(layer) - units) == [], "LAYERS names units that no longer exist"


def test_imports_go_downward_only() -> None:
    layer = _layer_of()
    wrong = []
    for module, targets in _import_graph().items():
        src = _unit(module)
        if src is None:
            continue
        for target in targets:
            dst = _unit(target)
            if dst is None:
                wrong.append(f"{module} -> {target} (the package root is for users only)")
            elif dst != src and layer.get(dst, -1) >= layer.get(src, -1):
                wrong.append(f"{module} -> {target}")
    assert sorted(wrong) == []


def test_private_modules_stay_inside() -> None:
    wrong = [f"{m} -> {t}" for m, targets in _import_graph().items() for t in targets
             if t in PRIVATE_MODULES and not (m + ".").startswith(PRIVATE_MODULES[t] + ".")]
    assert sorted(wrong) == []


def test_no_circles_between_units() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in _import_graph().items():
        for target in targets:
            a, b = _unit(module), _unit(target)
            if a and b and a != b:
                edges[a].add(b)
    # Depth-first search for a back edge; report the circle it closes.
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(unit: str) -> None:
        state[unit] = 1
        stack.append(unit)
        for nxt in sorted(edges[unit]):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[unit] = 2

    for unit in sorted(edges):
        if unit not in state:
            visit(unit)
    assert circles == []


def test_the_checker_sees_function_level_imports(tmp_path: Path) -> None:
    """The reader finds an import hidden in a function body and one under TYPE_CHECKING."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from tokenmill.engine import core\n"
                   "def f():\n    from tokenmill.cli import main\n    import tokenmill.config\n")
    mods = {"tokenmill.engine": Path("x"), "tokenmill.engine.core": Path("x"),
            "tokenmill.cli": Path("x"), "tokenmill.config": Path("x")}
    assert _imported("tokenmill.bench.m", src, mods) == {
        "tokenmill.engine.core", "tokenmill.cli", "tokenmill.config"}
