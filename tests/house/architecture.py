"""The architecture diagram of docs/architecture.md, drawn from the code.

Nodes are the parts (each package's first level: ``torch_neuronx.compile``, ``nki.isa``,
``neuronhw`` as one, the ``csrc/`` folders); an arrow A --> B means some module of A imports (or some
C++ file of A includes) one of B. ``python tests/house/architecture.py --write`` (or
``make architecture``) rewrites the diagram in the doc; the test checks it is current.
"""
from __future__ import annotations

import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_imports import ROOT, _graph  # noqa: E402

DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- architecture:begin -->", "<!-- architecture:end -->"


# Leaf modules every part of nki uses (its error classes and operator table): drawn, they
# would only add an arrow from every node.
_LEAVES = {"nki.errors", "nki._ops"}


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "neuronhw":
        return "neuronhw"                   # data: one node
    if len(parts) == 1:
        return None                         # a package's __init__ only gathers its parts
    part = ".".join(parts[:2])
    return None if part in _LEAVES else part


def _csrc_edges() -> set:
    """Folder-level include edges between the csrc/ folders (csrc/<folder>/...)."""
    edges = set()
    inc = re.compile(r'#include\s+"([^"]+)"')
    for f in (ROOT / "csrc").rglob("*"):
        if f.suffix not in (".cpp", ".h") or len(f.relative_to(ROOT / "csrc").parts) < 2:
            continue
        src = "csrc/" + f.relative_to(ROOT / "csrc").parts[0]
        for m in inc.finditer(f.read_text()):
            target = (f.parent / m.group(1)).resolve()
            rel = target.relative_to(ROOT / "csrc").parts if target.is_relative_to(ROOT / "csrc") else ()
            if len(rel) >= 2 and "csrc/" + rel[0] != src:
                edges.add((src, "csrc/" + rel[0]))
    return edges


def edges() -> list:
    graph, _ = _graph()
    out = set()
    for m, deps in graph.items():
        a = _part(m)
        for d in deps:
            b = _part(d)
            if a and b and a != b and b.split(".")[0] in ("torch_neuronx", "nki", "nkilib", "neuronhw"):
                out.add((a, b))
    return sorted(out | _csrc_edges())


def mermaid() -> str:
    def node(n):
        return n.replace(".", "_").replace("/", "_")
    lines = ["```mermaid", "flowchart LR"]
    names = sorted({n for e in edges() for n in e})
    for pkg, label in (("csrc", "C++ glue (csrc/)"), ("torch_neuronx", "torch_neuronx"),
                       ("nkilib", "nkilib"), ("nki", "nki"), ("neuronhw", "neuronhw")):
        members = [n for n in names if n.split("/")[0].split(".")[0] == pkg]
        if not members:
            continue
        lines.append(f"  subgraph {pkg}_pkg [\"{label}\"]")
        lines += [f"    {node(n)}[\"{n}\"]" for n in members]
        lines.append("  end")
    lines += [f"  {node(a)} --> {node(b)}" for a, b in edges()]
    lines.append("```")
    return "\n".join(lines)


def current_block() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")


def write() -> None:
    text = DOC.read_text()
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:a] + "\n" + mermaid() + "\n" + text[b:])


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    else:
        print(mermaid())
