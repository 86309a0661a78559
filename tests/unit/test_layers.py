"""The package's layering, read from its imports (module level, inside functions and under
TYPE_CHECKING alike): every import goes to a lower layer, no units import each other in a
circle, and the "never" rules of the architecture hold (benchmarks never reach the runner or
attention; the scheduler never imports torch; models never import engine code; the server
talks to the engine only). The README's engine map shows the same table."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import tokenmill

PACKAGE_DIR = Path(tokenmill.__file__).parent

# Lowest first. A unit is a subpackage or a top-level module of `tokenmill`; it may import
# units of a lower layer only (never one of its own layer, never a higher one).
LAYERS: list[tuple[str, ...]] = [
    ("envs",),
    ("utils",),
    ("kernels",),
    ("presets", "sampling_params", "lora_request", "hub", "options"),
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
    ("retrieval", "monitoring", "tenancy"),
    ("server", "batch", "stream", "chat"),
    ("bench", "chat_remote", "serve_ray"),
    ("cli",),
    ("__main__",),
]

# Modules that only their own subpackage may import: the outside uses the public surface.
PRIVATE_MODULES = {"tokenmill.engine.core": "tokenmill.engine"}

# The architecture's "never" rules, on top of "downward only". Each: the unit, the units it
# never imports (even lower ones), and why.
NEVER: list[tuple[str, frozenset[str], str]] = [
    # A benchmark drives public interfaces (the LLM, the engine, the server, the CLI).
    ("bench", frozenset({"runner", "attention", "executor", "spec_decode"}),
     "benchmarks drive public interfaces, never the runner or attention"),
    # A model is a plain nn.Module: it knows nothing of requests, the scheduler or the cache.
    ("models", frozenset({"core", "request", "detokenizer", "metrics", "structured",
                          "outputs", "sampling_params", "lora_request", "tokenizer"}),
     "models never import engine code"),
]
# The server (HTTP only) reaches the engine through api/ and the engine's public modules, and
# the services beside the engine (retrieval, ops, tenancy); besides those, only plain data types.
SERVER_TALKS_TO = frozenset({"api", "engine", "retrieval", "monitoring", "tenancy", "config", "outputs",
                             "sampling_params", "lora_request", "metrics", "utils", "envs"})
# The scheduler and the block pool are pure Python: none of core/'s modules, nor anything they
# import when loaded (the package root, the users' facade, aside), imports these.
TORCH_MODULES = frozenset({"torch", "triton", "numpy"})


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


def test_never_rules() -> None:
    """The architecture's "never" rules: each names the import that breaks it."""
    wrong = []
    for module, targets in _import_graph().items():
        src = _unit(module)
        for unit, banned, rule in NEVER:
            wrong += [f"{module} -> {t} ({rule})" for t in targets
                      if src == unit and _unit(t) in banned]
        if src == "server":
            wrong += [f"{module} -> {t} (the server talks to the engine only)" for t in targets
                      if _unit(t) not in SERVER_TALKS_TO | {"server"}]
    assert sorted(wrong) == []


def _runtime_imports(module: str, path: Path) -> set[str]:
    """What ``module`` (at ``path``) imports when it is loaded: module and class bodies,
    ``try``/``if`` blocks, never function bodies or ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    package = (module if path.name == "__init__.py" else module.rsplit(".", 1)[0]).split(".")

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                origin = ".".join(p for p in (base, node.module or "") if p)
                found.add(origin)
                found.update(f"{origin}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef, ast.For)):
                for part in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, part, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])
    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def _loaded_with(module: str, mods: dict[str, Path]) -> set[str]:
    """Every name imported while ``module`` loads: its own imports, its packages' ``__init__``
    files and theirs, transitively (the package root aside)."""
    seen: set[str] = set()
    names: set[str] = set()
    todo = [module]
    while todo:
        mod = todo.pop()
        parts = mod.split(".")
        for i in range(2, len(parts) + 1):  # the packages on the way, then the module
            name = ".".join(parts[:i])
            if name in mods and name not in seen:
                seen.add(name)
                imported = _runtime_imports(name, mods[name])
                names |= imported
                todo += [n for n in imported if n.split(".")[0] == "tokenmill" and n in mods]
    return names


def test_the_scheduler_never_imports_torch() -> None:
    mods = _modules()
    wrong = [f"{m} loads {n}" for m in sorted(mods) if _unit(m) == "core"
             for n in sorted(_loaded_with(m, mods)) if n.split(".")[0] in TORCH_MODULES]
    assert wrong == [], "core/ (scheduler, block pool) must stay pure Python"


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    """The readers behind the rules find torch loaded two imports away, and not under
    TYPE_CHECKING or in a function."""
    pkg = tmp_path / "tokenmill"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "sched.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n"
        "def f():\n    import triton\ntry:\n    from .. import helper\nexcept ImportError:\n"
        "    pass\n")
    (pkg / "helper.py").write_text("class A:\n    import torch.nn as nn\n")
    mods = {"tokenmill.core": pkg / "core" / "__init__.py",
            "tokenmill.core.sched": pkg / "core" / "sched.py", "tokenmill.helper": pkg / "helper.py"}
    loaded = _loaded_with("tokenmill.core.sched", mods)
    assert "torch.nn" in loaded and "tokenmill.helper" in loaded
    assert not {"numpy", "triton"} & loaded
