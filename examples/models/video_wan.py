"""Video diffusion: a diffusers Wan video transformer (``WanTransformer3DModel``: 3-D patches,
rotary attention over frames x height x width, text cross-attention) with flow matching: a
training step on a short clip, then a few Euler sampling steps.
Run: ``python examples/models/video_wan.py``."""
import torch
import torch.nn.functional as F

try:
    from ._harness import Family, main
except ImportError:
    from _harness import Family, main


def build():
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                 in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                                 num_layers=2, rope_max_seq_len=32)


def batch():
    g = torch.Generator().manual_seed(5)
    clip = torch.randn(1, 4, 3, 8, 8, generator=g)          # (batch, channels, frames, h, w)
    noise = torch.randn(1, 4, 3, 8, 8, generator=g)
    t = torch.rand(1, generator=g)
    text = torch.randn(1, 6, 32, generator=g)
    return clip, noise, t, text


def loss(model, b):
    clip, noise, t, text = b
    s = t.view(-1, 1, 1, 1, 1)
    x = (1 - s) * clip + s * noise                          # rectified flow: straight paths
    v = model(x, timestep=t * 1000, encoder_hidden_states=text).sample
    return F.mse_loss(v.float(), (noise - clip).float())


def infer(model, b):
    _, noise, _, text = b
    x, steps = noise, 3
    for i in range(steps, 0, -1):
        t = torch.full((x.shape[0],), i / steps, device=x.device)
        v = model(x, timestep=t * 1000, encoder_hidden_states=text).sample
        x = x - v / steps
    return x


FAMILY = Family("video diffusion (Wan)", build, batch, loss, infer)

if __name__ == "__main__":
    main(FAMILY)
