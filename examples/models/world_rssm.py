"""World model: a Dreamer-style recurrent state-space model (RSSM), in plain PyTorch: a conv
image encoder, a GRU deterministic state, a stochastic categorical latent sampled with
straight-through gradients, a conv decoder, a reward head, and an imagination rollout of a
small actor in latent space. Run: ``python examples/models/world_rssm.py``."""
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from ._harness import Family, main
except ImportError:
    from _harness import Family, main

DETER, CLASSES, GROUPS, ACTIONS, EMBED = 32, 8, 4, 3, 32
STOCH = CLASSES * GROUPS


class RSSM(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 4, 2, 1), nn.SiLU(), nn.Conv2d(8, 16, 4, 2, 1),
                                     nn.SiLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, EMBED))
        self.img_in = nn.Linear(STOCH + ACTIONS, DETER)
        self.cell = nn.GRUCell(DETER, DETER)
        self.prior = nn.Linear(DETER, STOCH)
        self.posterior = nn.Linear(DETER + EMBED, STOCH)
        self.decoder_in = nn.Linear(DETER + STOCH, 16 * 4 * 4)
        self.decoder = nn.Sequential(nn.ConvTranspose2d(16, 8, 4, 2, 1), nn.SiLU(),
                                     nn.ConvTranspose2d(8, 3, 4, 2, 1))
        self.reward = nn.Sequential(nn.Linear(DETER + STOCH, 32), nn.SiLU(), nn.Linear(32, 1))
        self.actor = nn.Sequential(nn.Linear(DETER + STOCH, 32), nn.SiLU(), nn.Linear(32, ACTIONS))

    @staticmethod
    def sample(logits):
        """A one-hot sample per group, with straight-through gradients to the probabilities."""
        logits = logits.view(*logits.shape[:-1], GROUPS, CLASSES)
        probs = logits.softmax(-1)
        idx = torch.multinomial(probs.reshape(-1, CLASSES).float(), 1).view(probs.shape[:-1])
        hard = F.one_hot(idx, CLASSES).to(probs.dtype)
        return (hard + probs - probs.detach()).flatten(-2), probs

    def observe(self, frames, actions):
        """Filter a sequence: returns features per step and the KL between posterior and prior."""
        b, steps = frames.shape[:2]
        embed = self.encoder(frames.flatten(0, 1)).view(b, steps, EMBED)
        h = frames.new_zeros(b, DETER)
        z = frames.new_zeros(b, STOCH)
        feats, kl = [], 0.0
        for t in range(steps):
            h = self.cell(F.silu(self.img_in(torch.cat([z, actions[:, t]], -1))), h)
            _, prior = self.sample(self.prior(h))
            z, post = self.sample(self.posterior(torch.cat([h, embed[:, t]], -1)))
            kl = kl + (post * (post.clamp_min(1e-6).log() - prior.clamp_min(1e-6).log())).sum(-1).mean()
            feats.append(torch.cat([h, z], -1))
        return torch.stack(feats, 1), kl / steps

    def forward(self, frames, actions):
        """One training pass: features, KL, reconstructed frames and predicted rewards."""
        feats, kl = self.observe(frames, actions)
        recon = self.decode(feats.flatten(0, 1)).view_as(frames)
        return feats, kl, recon, self.reward(feats).squeeze(-1)

    def decode(self, feat):
        x = self.decoder_in(feat).view(-1, 16, 4, 4)
        return self.decoder(x)

    def imagine(self, feat, horizon):
        """Roll the actor forward in latent space; the predicted rewards."""
        h, z = feat[:, :DETER], feat[:, DETER:]
        rewards = []
        for _ in range(horizon):
            a = F.one_hot(self.actor(torch.cat([h, z], -1)).argmax(-1), ACTIONS).to(h.dtype)
            h = self.cell(F.silu(self.img_in(torch.cat([z, a], -1))), h)
            z, _ = self.sample(self.prior(h))
            rewards.append(self.reward(torch.cat([h, z], -1)).squeeze(-1))
        return torch.stack(rewards, 1)


def build():
    return RSSM()


def batch():
    g = torch.Generator().manual_seed(6)
    frames = torch.rand(2, 4, 3, 16, 16, generator=g)
    actions = F.one_hot(torch.randint(0, ACTIONS, (2, 4), generator=g), ACTIONS).float()
    rewards = torch.randn(2, 4, generator=g)
    return frames, actions, rewards


def loss(model, b):
    frames, actions, rewards = b
    _, kl, recon, r = model(frames, actions)
    return F.mse_loss(recon.float(), frames) + F.mse_loss(r.float(), rewards) + 0.1 * kl.float()


def infer(model, b):
    frames, actions, _ = b
    feats, _ = model.observe(frames, actions)
    return model.imagine(feats[:, -1], horizon=5)


FAMILY = Family("world model (RSSM)", build, batch, loss, infer)

if __name__ == "__main__":
    main(FAMILY)
