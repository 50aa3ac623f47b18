"""A tiny Flux text-to-image pipeline saved to a local directory, built offline: seeded random
weights from configs, and both tokenizers (CLIP's BPE, T5's unigram) built in memory over a
few words."""
from __future__ import annotations

from pathlib import Path

# One small request: a 32x32 image (16x16 latents, 64 packed tokens), 2 denoising steps, the
# pipeline's default guidance (Flux without guidance embeddings ignores it).
REQUEST = dict(height=32, width=32, num_inference_steps=2)
PROMPT = "a red cat sat on the blue mat"
WORDS = ("a", "the", "cat", "dog", "sat", "on", "mat", "red", "blue")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _clip_tokenizer():
    """CLIP's byte-pair encoding over WORDS: letters, then one merge per letter of a word, so
    every word of WORDS is one token and anything else falls back to letters."""
    from transformers import CLIPTokenizer
    vocab, merges = {}, []
    for t in ["<|startoftext|>", "<|endoftext|>", *_LETTERS, *(c + "</w>" for c in _LETTERS)]:
        vocab.setdefault(t, len(vocab))
    for w in WORDS:
        left = w[0]
        for i, c in enumerate(w[1:], 1):
            right = c + ("</w>" if i == len(w) - 1 else "")
            if (left, right) not in merges:
                merges.append((left, right))
            left += right
            vocab.setdefault(left, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=16)


def _t5_tokenizer():
    from transformers import T5Tokenizer
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -1.0) for w in WORDS] + [(c, -3.0) for c in _LETTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def build(path: Path) -> Path:
    import torch
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                           FluxTransformer2DModel)
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok, tok_2 = _clip_tokenizer(), _t5_tokenizer()
    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=16, projection_dim=32,
        bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok_2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1)).eval()
    # in_channels: the VAE's 4 latent channels packed 2x2; rope axes sum to the head dim.
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
        layers_per_block=1, norm_num_groups=8, scaling_factor=0.5, shift_factor=0.1)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=16, max_image_seq_len=256)
    FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tok,
                 text_encoder_2=t5, tokenizer_2=tok_2, transformer=transformer
                 ).save_pretrained(path)
    return path


def reference(path: Path, prompt: str, seed: int, **request):
    """The image (H, W, 3) uint8 from diffusers' ``FluxPipeline`` on the CPU, rounded to 8 bits
    as its PIL output is."""
    import numpy as np
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(path, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator("cpu").manual_seed(seed)
    return np.asarray(pipe(prompt, generator=gen, output_type="pil", **request).images[0])
