"""The gated MLP (``nkilib.core.mlp.mlp.mlp``); import it from its module, as AWS's package
lays it out."""
