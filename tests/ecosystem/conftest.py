import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))   # the tests run the examples' own code

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
