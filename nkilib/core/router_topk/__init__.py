"""MoE router: logits, activation and top-k experts
(``from nkilib.core.router_topk.router_topk import router_topk``)."""
