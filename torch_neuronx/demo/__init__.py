"""The main job: train a small GPT on the virtual Trainium device (``torchneuron demo``)."""
