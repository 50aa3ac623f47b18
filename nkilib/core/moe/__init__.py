"""Mixture-of-experts kernels."""
