"""Image diffusion: a diffusers DiT (``DiTTransformer2DModel``, class-conditional, adaLN-zero)
with a DDPM noise schedule: a denoising training step, then a few DDIM sampling steps.
Run: ``python examples/models/image_dit.py``."""
import torch
import torch.nn.functional as F

try:
    from ._harness import Family, main
except ImportError:
    from _harness import Family, main

TRAIN_STEPS = 100


def build():
    from diffusers import DiTTransformer2DModel
    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, num_layers=2, sample_size=8, patch_size=2,
                                 num_embeds_ada_norm=10, norm_num_groups=1)


def batch():
    g = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 4, 8, 8, generator=g)
    noise = torch.randn(2, 4, 8, 8, generator=g)
    t = torch.randint(0, TRAIN_STEPS, (2,), generator=g)
    labels = torch.randint(0, 10, (2,), generator=g)
    return latents, noise, t, labels


def _scheduler(cls_name="DDPMScheduler"):
    import diffusers
    return getattr(diffusers, cls_name)(num_train_timesteps=TRAIN_STEPS)


def loss(model, b):
    latents, noise, t, labels = b
    noisy = _scheduler().add_noise(latents, noise, t)
    pred = model(noisy, timestep=t, class_labels=labels).sample
    return F.mse_loss(pred.float(), noise.float())


def infer(model, b):
    _, noise, _, labels = b
    sched = _scheduler("DDIMScheduler")
    sched.set_timesteps(4)
    x = noise
    for t in sched.timesteps:
        eps = model(x, timestep=t.expand(x.shape[0]).to(x.device), class_labels=labels).sample
        x = sched.step(eps, t, x).prev_sample
    return x


FAMILY = Family("image diffusion (DiT)", build, batch, loss, infer)

if __name__ == "__main__":
    main(FAMILY)
