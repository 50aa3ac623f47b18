"""Losses: cross-entropy forward and backward for large vocabularies
(``from nkilib.experimental.loss.cross_entropy import cross_entropy_forward``)."""
