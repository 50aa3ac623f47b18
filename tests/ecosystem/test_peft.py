"""PEFT LoRA on neuron, unchanged: a plain loop and Trainer fine-tune the tiny Llama with
the same losses as on CPU, and merge_and_unload gives the same merged weights and logits."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

import peft_lora  # noqa: E402  (examples/ is on sys.path: conftest)


def _same(ours: dict, ref: dict):
    assert ours["losses"] == ref["losses"]
    assert ours["trainable"] == ref["trainable"] and ours["trainable"] < 10_000
    assert torch.equal(ours["adapted"], ref["adapted"])
    assert torch.equal(ours["merged"], ref["merged"])
    # merging changes the arithmetic, not the function
    assert torch.allclose(ours["merged"], ours["adapted"], atol=1e-5)
    ref_state = ref["model"].state_dict()
    for k, v in ours["model"].state_dict().items():
        assert "lora" not in k
        assert torch.equal(v.cpu(), ref_state[k]), k


def test_lora_plain_loop_equals_cpu(in_tmp):
    ours = peft_lora.main(["--steps", "4"])
    assert ours["device"] == "neuron:0"
    _same(ours, peft_lora.main(["--steps", "4", "--device", "cpu"]))


def test_lora_trainer_equals_cpu(in_tmp):
    ours = peft_lora.main(["--trainer", "--steps", "4"])
    assert ours["device"] == "neuron:0"
    _same(ours, peft_lora.main(["--trainer", "--steps", "4", "--use_cpu"]))
