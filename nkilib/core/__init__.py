"""The kernels behind TorchNeuron's attention, norms, embeddings and MLP."""
