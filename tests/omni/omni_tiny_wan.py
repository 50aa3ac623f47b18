"""A tiny Wan text-to-video pipeline saved to a local directory, built offline: seeded
random weights from configs, the in-memory BPE tokenizer of examples/tiny_llama.py."""
from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# One small request: 5 frames of 32x32, 2 denoising steps, no classifier-free guidance.
REQUEST = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0)
FLOW_SHIFT = 3.0
PROMPT = "the cat sat on the mat"


def build(path: Path) -> Path:
    sys.path.insert(0, str(EXAMPLES))
    import tiny_llama
    import torch
    from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline,
                           WanTransformer3DModel)
    from transformers import UMT5Config, UMT5EncoderModel

    tok = tiny_llama.tokenizer()
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tok.pad_token_id)).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True],
                           latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder, transformer=transformer,
                       vae=vae, scheduler=scheduler)
    pipe.save_pretrained(path)
    return path


def reference(path: Path, prompt: str, seed: int, flow_shift: float, **request):
    """Frames (N, H, W, 3) in [0, 1] from diffusers' ``WanPipeline`` on the CPU, with the
    flow-matching UniPC solver vLLM-Omni's Wan pipeline steps with (its default
    ``sample_solver``; diffusers' own UniPC schedules its sigmas differently)."""
    import torch
    from diffusers import WanPipeline
    from vllm_omni.diffusion.models.schedulers import FlowUniPCMultistepScheduler

    pipe = WanPipeline.from_pretrained(path, torch_dtype=torch.float32)
    pipe.scheduler = FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=flow_shift,
                                                 prediction_type="flow_prediction")
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator("cpu").manual_seed(seed)
    return pipe(prompt, generator=gen, output_type="np", **request).frames[0]
