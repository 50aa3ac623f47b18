"""The runtime: device table from the NEURON_* environment (memory lives in the C++ glue)."""
