"""Cumulative sum along the last axis (``from nkilib.core.cumsum.cumsum import cumsum``)."""
