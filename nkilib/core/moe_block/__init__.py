"""The fused MoE block for token generation: RMSNorm, router and experts in one kernel
(``from nkilib.core.moe_block.moe_block_tkg import moe_block_tkg``)."""
