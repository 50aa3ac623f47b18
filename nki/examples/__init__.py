"""Example NKI kernels (used by docs/nki.md and the tests)."""
