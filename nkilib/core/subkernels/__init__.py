"""Subkernels: RMSNorm (``rmsnorm_tkg``) and LayerNorm (``layernorm_tkg``); import each from
its module (``from nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg``)."""
