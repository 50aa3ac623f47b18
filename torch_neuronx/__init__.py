"""torch_neuronx: the neuron device (placeholder while the runtime is being built)."""
