"""Attention: prefill (``attention_cte``), backward (``attention_bwd``) and decode against a
contiguous or paged KV cache (``attention_tkg``); import each from its module, as AWS's
package lays them out (``from nkilib.core.attention.attention_cte import attention_cte``)."""
