"""docs/architecture.md's diagram is the one the code draws (``make architecture``)."""
import architecture


def test_architecture_diagram_is_current():
    assert architecture.current_block() == architecture.mermaid(), (
        "docs/architecture.md's diagram is stale: run `make architecture`")


def test_diagram_shows_the_layering():
    edges = set(architecture.edges())
    assert ("torch_neuronx.nki_bridge", "nki.frameworks") in edges
    assert ("nki.simulator", "neuronhw") in edges
    assert not any(a.startswith("nki") and b.startswith("torch_neuronx") for a, b in edges)
