"""Attention: prefill (``attention_cte``) and backward (``attention_bwd``); import each from
its module, as AWS's package lays them out
(``from nkilib.core.attention.attention_cte import attention_cte``)."""
