"""Top-k along the last dimension (``from nkilib.core.topk.rotational_topk import rotational_topk``;
its configuration lives in ``nkilib.core.topk.rotational_topk_utils``, as in AWS's library)."""
