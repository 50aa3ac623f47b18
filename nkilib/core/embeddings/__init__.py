"""Embeddings: rotary position embedding (``from nkilib.core.embeddings.rope import RoPE``)."""
