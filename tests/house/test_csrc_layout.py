"""csrc/'s layout and include direction, read from the source.

Folders: ``runtime`` (device table, allocator, queues, stream checker, op record) depends on
nothing else of ours; ``fusion`` (the Adaptive Eager window) on ``runtime``; ``aten`` (base
kernels, fallback, launch path, autocast) on both; ``profiler`` (the Kineto plugin) on ``runtime``, implementing the trace hooks
``runtime/record.h`` declares; ``python`` (the bindings) on everything.
The runtime reaches the fusion window only through the hook the window registers
(``queue::set_window_closer``), so no file below a folder names a namespace above it.
"""
from __future__ import annotations

import pathlib
import re

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
ALLOWED = {
    "runtime": set(),
    "fusion": {"runtime"},
    "aten": {"runtime", "fusion"},
    "profiler": {"runtime"},
    "python": {"runtime", "fusion", "aten", "profiler"},
}
# Namespaces each folder owns: a lower folder must not call into a higher one's.
OWNS = {"fusion": ("fusion::",), "aten": ("launch::",)}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _sources():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h"))


def _folder(p: pathlib.Path) -> str:
    return p.relative_to(CSRC).parts[0]


def test_every_source_is_in_a_known_folder_with_a_readme():
    for p in _sources():
        assert len(p.relative_to(CSRC).parts) == 2, f"{p.relative_to(CSRC)}: csrc/ has no flat files"
        assert _folder(p) in ALLOWED, f"{p.relative_to(CSRC)}: unknown folder"
    for folder in ALLOWED:
        assert (CSRC / folder / "README.md").is_file(), f"csrc/{folder} needs a README.md"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(CSRC)))
def test_includes_point_down(path):
    src = _folder(path)
    for inc in _INCLUDE.findall(path.read_text()):
        target = (path.parent / inc).resolve()
        assert target.is_file(), f"{path.relative_to(CSRC)} includes {inc}, which does not exist"
        dst = _folder(target)
        assert dst == src or dst in ALLOWED[src], (
            f"csrc/{src} may not include csrc/{dst} ({path.relative_to(CSRC)}: #include \"{inc}\")")


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(CSRC)))
def test_no_calls_up_the_layers(path):
    src = _folder(path)
    code = re.sub(r"//[^\n]*", "", path.read_text())  # comments may name anything
    for owner, prefixes in OWNS.items():
        if owner == src or owner in ALLOWED[src]:
            continue
        for prefix in prefixes:
            assert not re.search(r"\b" + re.escape(prefix), code), (
                f"{path.relative_to(CSRC)} calls {prefix}..., but csrc/{src} sits below csrc/{owner}")


def test_setup_builds_every_source():
    setup = (CSRC.parent / "setup.py").read_text()
    assert 'glob.glob("csrc/*/*.cpp")' in setup
