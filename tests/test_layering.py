"""Imports flow down the layers of docs/design.md: a lower layer never imports a higher one.

Every `import` in src/k3stream (module level or inside a function) is read with `ast`; a module belongs
to its package's layer (`engine/parallel/` is a layer of its own, above the rest of `engine`); `cli.py`
and `__main__.py` belong to `commands`, the top layer. The edges known to break the rule today are
listed once, below, and must leave the list when fixed.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import k3stream

SOURCE = Path(k3stream.__file__).parent

# each layer and the layers directly beneath it: a layer may import what lies beneath it, directly or
# not, and nothing else ("api" is the `k3stream` package itself: load, nonexpert_weights)
BENEATH: dict[str, tuple[str, ...]] = {
    "quant": (),
    "experts": ("quant",),  # k3stream/experts.py: the routed-expert interface
    "gguf": ("quant", "experts"),
    "pack": ("gguf",),
    "model": ("gguf", "quant"),
    "store": ("pack",),
    "memlimit": ("gguf",),  # k3stream/memlimit.py: the memory plan (limits, what a checkpoint needs)
    "api": ("model", "pack", "memlimit"),
    "engine": ("api", "model", "store", "pack"),
    "server": ("engine",),
    "engine.parallel": ("engine",),  # engine/parallel/: the rest of the engine never imports it
    "train": ("engine",),  # writes its GGUFs with gguf.writer, never with the test makers
    # test models and inputs (tiny GGUFs, random blocks, hostile files, cgroups): only commands and the
    # tests above import them
    "testing": ("gguf", "pack", "memlimit"),
    "commands": ("server", "engine.parallel", "train", "testing"),  # every subcommand, cli.py, __main__.py
}
# the layers no library module may import, whatever BENEATH says
ABOVE_THE_LIBRARY = ("commands", "testing")

# Known violations (importer, imported): none left. A new one fails the test; an entry added here must
# say why, and be deleted once fixed.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if parts[1] in ("cli", "__main__"):
        return "commands"
    if parts[1:3] == ["engine", "parallel"]:
        return "engine.parallel"
    return parts[1]


@cache
def beneath(layer: str) -> frozenset[str]:
    """Every layer beneath `layer`, directly or not."""
    below: set[str] = set()
    for lower in BENEATH[layer]:
        below |= {lower, *beneath(lower)}
    return frozenset(below)


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (SOURCE / relative).with_suffix(".py").is_file() or (SOURCE / relative / "__init__.py").is_file()


def imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The k3stream modules one import statement names (`from k3stream import __version__` names none:
    importing a submodule imports the package anyway)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "k3stream"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".")[: None if is_package else -1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    if base.split(".")[0] != "k3stream":
        return []
    named = [f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")]
    plain = {alias.name for alias in node.names if not _is_module(f"{base}.{alias.name}")}
    from_package = plain - {"__version__"} if base == "k3stream" else plain
    return named + ([base] if from_package else [])


def import_edges() -> set[tuple[str, str]]:
    """(importer, imported) for every import of a k3stream module in src/k3stream."""
    edges = set()
    for path in sorted(SOURCE.rglob("*.py")):
        module = module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            for imported in imported_modules(node, module, path.name == "__init__.py"):
                edges.add((module, imported))
    return edges


def violations(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges from one layer to another that is not beneath it."""
    return {
        (importer, imported)
        for importer, imported in edges
        if layer_of(importer) != layer_of(imported) and layer_of(imported) not in beneath(layer_of(importer))
    }


def test_every_layer_is_placed():
    layers = {layer_of(module) for edge in import_edges() for module in edge}
    assert layers <= set(BENEATH), f"place these in BENEATH: {sorted(layers - set(BENEATH))}"


def test_no_lower_layer_imports_a_higher_one():
    found = violations(import_edges())
    new, fixed = sorted(found - KNOWN_EXCEPTIONS), sorted(KNOWN_EXCEPTIONS - found)
    assert not new, f"lower layers import higher ones: {new}"
    assert not fixed, f"fixed, so delete them from KNOWN_EXCEPTIONS: {fixed}"


def test_no_library_module_imports_a_command_or_a_test_maker():
    found = {
        (importer, imported)
        for importer, imported in import_edges()
        if layer_of(imported) in ABOVE_THE_LIBRARY and layer_of(importer) not in ABOVE_THE_LIBRARY
    }
    assert not found, f"library modules import commands or test makers: {sorted(found)}"


def test_the_check_sees_function_level_and_relative_imports():
    importer = "k3stream.gguf.reader"
    source = "def f():\n    from ..engine import generate\n    import k3stream.server.app\n"
    nodes = list(ast.walk(ast.parse(source)))
    edges = {(importer, name) for node in nodes for name in imported_modules(node, importer, False)}
    assert violations(edges) == {(importer, "k3stream.engine.generate"), (importer, "k3stream.server.app")}
    assert not violations({("k3stream.engine.loading", "k3stream.pack.builder")})


def test_design_md_places_every_layer():
    """docs/design.md's Layers paragraph, the contract this test holds, names every layer BENEATH has."""
    design = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    paragraph = design[design.index("**Layers**") :].split("\n\n", 1)[0]
    unnamed = [layer for layer in BENEATH if layer != "api" and f"`{layer}`" not in paragraph]
    assert not unnamed, f"docs/design.md's Layers paragraph does not place {unnamed}"
