"""Experimental kernels, under AWS's ``nkilib.experimental`` paths (import each from its module)."""
