"""Attention: prefill (``attention_cte``), backward (``attention_bwd``), decode against a
paged KV cache (``attention_tkg``)."""
from .attention_bwd import attention_bwd  # noqa: F401
from .attention_cte import attention_cte  # noqa: F401
