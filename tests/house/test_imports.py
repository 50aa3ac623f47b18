"""The packages' dependency direction, read from the source (no imports run).

Allowed arrows: ``torch_neuronx -> nki -> neuronhw`` and ``nkilib -> nki`` (``nkilib`` is
also read by ``torch_neuronx``); ``neuronhw`` is data and imports nothing of ours. ``nki``
imports neither torch nor ``torch_neuronx``: the torch side registers itself with it
(``nki.frameworks``). Inside the packages, modules import each other without cycles.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("torch_neuronx", "nki", "nkilib", "neuronhw")
# Which of our packages (and torch) each package may import.
ALLOWED = {
    "neuronhw": set(),
    "nki": {"neuronhw"},
    "nkilib": {"nki", "neuronhw"},
    "torch_neuronx": {"nki", "nkilib", "neuronhw", "torch"},
}


def _modules() -> dict:
    """Dotted module name -> path, for every module of our packages."""
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = p
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict) -> set:
    """Modules ``name`` imports (anywhere in the file), resolved to our modules or to
    top-level package names for everything else."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            # ``from pkg import sub`` imports the submodule when there is one.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t not in mods and "." in t:
                t = t.rsplit(".", 1)[0]
            out.add(t)
    out.discard(name)
    return out


def _graph():
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}, mods


def _against_direction(graph: dict) -> list:
    bad = []
    for m, deps in graph.items():
        pkg = m.split(".")[0]
        for d in deps:
            top = d.split(".")[0]
            if top != pkg and (top in PACKAGES or top == "torch") and top not in ALLOWED[pkg]:
                bad.append(f"{m} imports {d}")
    return sorted(bad)


def test_packages_import_only_downward():
    graph, _ = _graph()
    bad = _against_direction(graph)
    assert not bad, "imports against the allowed direction:\n" + "\n".join(bad)


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def _without_package_inits(graph: dict) -> dict:
    # A package's __init__ gathers its public names from its submodules, and submodules
    # take shared objects (the extension, the state) from their package: those arrows are
    # Python's package mechanism, not a design dependency. Everything else must be acyclic.
    return {m: {d for d in deps if not (m.startswith(d + ".") or d.startswith(m + "."))}
            for m, deps in graph.items()}


def test_no_import_cycles():
    graph, _ = _graph()
    cycles = _cycles(_without_package_inits(graph))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_checks_can_fail(tmp_path):
    # The reader resolves relative and function-level imports, and both checks flag what
    # they must: nki reaching up to torch_neuronx or torch, and a cycle.
    src = tmp_path / "runner.py"
    src.write_text("def f():\n    from ..frameworks import bridge_for\n    import torch\n"
                   "    from torch_neuronx import cost_model\n")
    deps = _imports("nki.simulator.runner", src, _modules())
    assert {"nki.frameworks", "torch", "torch_neuronx.cost_model"} <= deps
    assert _against_direction({"nki.simulator.runner": deps}) == [
        "nki.simulator.runner imports torch", "nki.simulator.runner imports torch_neuronx.cost_model"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
