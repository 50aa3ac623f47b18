import os
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))   # the tests run the examples' own code

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a fresh directory: the examples write their outputs under out/."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
