"""Vision-language: a LLaVA model (Transformers ``LlavaForConditionalGeneration``: a CLIP
vision tower, a projector, a Llama decoder) from a tiny config; image + text in, ``generate``
out. Run: ``python examples/models/vlm_llava.py``."""
import torch

try:
    from ._harness import Family, main
except ImportError:
    from _harness import Family, main

IMAGE_TOKEN = 127
PATCHES = (32 // 8) ** 2   # image 32x32, patch 8: one text position per patch


def build():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    cfg._attn_implementation = "sdpa"
    return LlavaForConditionalGeneration(cfg)


def batch():
    g = torch.Generator().manual_seed(3)
    text = torch.randint(3, 120, (2, 8), generator=g)
    ids = torch.cat([text[:, :1], torch.full((2, PATCHES), IMAGE_TOKEN), text[:, 1:]], dim=1)
    pixels = torch.randn(2, 3, 32, 32, generator=g)
    return ids, pixels


def loss(model, b):
    ids, pixels = b
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    return model(input_ids=ids, pixel_values=pixels, labels=labels).loss


def infer(model, b):
    ids, pixels = b
    return model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=4, do_sample=False,
                          pad_token_id=0)


FAMILY = Family("vision-language (LLaVA)", build, batch, loss, infer)

if __name__ == "__main__":
    main(FAMILY)
