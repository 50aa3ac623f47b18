"""``python -m torch_neuronx.profiler DIR``: the bottleneck report (see profiling/explore.py)."""
import sys

from .profiling.explore import main

if __name__ == "__main__":
    sys.exit(main())
