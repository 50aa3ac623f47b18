"""MoE for token generation (decode): the experts of up to 128 tokens
(``from nkilib.core.moe.moe_tkg.moe_tkg import moe_tkg``)."""
