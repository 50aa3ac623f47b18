"""Transformers v5 on neuron, unchanged: Trainer picks the device by itself and its loss
curve equals the same run on CPU (bit for bit in fp32 eager); generate() equals CPU."""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_trainer_finetune as example  # noqa: E402  (examples/ is on sys.path: conftest)
import tiny_llama  # noqa: E402

STEPS = ["--max_steps", "4"]


@functools.lru_cache(maxsize=None)
def _cpu_run(*flags):
    """The reference: the same example on CPU (Trainer's own --use_cpu)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        trainer, losses = example.main(STEPS + ["--output_dir", d, "--use_cpu", *flags])
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return losses, state


def _neuron_run(tmp_path, *flags):
    trainer, losses = example.main(STEPS + ["--output_dir", str(tmp_path), *flags])
    assert trainer.args.device.type == "neuron", trainer.args.device
    assert next(trainer.model.parameters()).device.type == "neuron"
    return trainer, losses


def _same_state(model, ref: dict):
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), ref[k]), k


def test_trainer_picks_neuron_and_equals_cpu_bitwise_then_resumes(tmp_path):
    assert transformers.utils.import_utils.is_torch_neuron_available()
    ref_losses, ref_state = _cpu_run()
    trainer, losses = _neuron_run(tmp_path, "--save_strategy", "steps", "--save_steps", "2")
    assert losses == ref_losses
    _same_state(trainer.model, ref_state)
    # resume from the step-2 checkpoint: model, optimizer, scheduler and RNG state come back
    resumed, history = _neuron_run(tmp_path, "--resume_from_checkpoint", str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 4 and history == losses   # steps 3-4 recomputed
    _same_state(resumed.model, ref_state)


def test_trainer_accumulation_and_checkpointing_bitwise(tmp_path):
    flags = ("--gradient_accumulation_steps", "2", "--gradient_checkpointing")
    ref_losses, ref_state = _cpu_run(*flags)
    trainer, losses = _neuron_run(tmp_path, *flags)
    assert losses == ref_losses
    _same_state(trainer.model, ref_state)


def test_trainer_bf16(tmp_path):
    ref_losses, _ = _cpu_run("--bf16")
    _, losses = _neuron_run(tmp_path, "--bf16")
    assert losses == pytest.approx(ref_losses, rel=2e-2)


def test_trainer_torch_compile(tmp_path):
    ref_losses, _ = _cpu_run()
    trainer, losses = _neuron_run(tmp_path, "--torch_compile")
    assert trainer.args.torch_compile_backend == "neuron"
    assert losses == pytest.approx(ref_losses, rel=1e-4)


@functools.lru_cache(maxsize=None)
def _tok_and_model():
    tok = tiny_llama.tokenizer()
    return tok, tiny_llama.model(tok, seed=3).eval()


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids.to(model.device), max_new_tokens=8, pad_token_id=0, **kw).cpu()


@pytest.mark.parametrize("kw", [dict(do_sample=False), dict(do_sample=True, top_k=20)],
                         ids=["greedy", "sampling"])
def test_generate_equals_cpu(kw):
    tok, cpu_model = _tok_and_model()
    ids = torch.tensor([tok("the cat sat on")["input_ids"]])
    torch.manual_seed(7)
    ref = _generate(cpu_model, ids, **kw)
    dev = tiny_llama.model(tok, seed=3).eval().to("neuron")
    torch.manual_seed(7)
    assert torch.equal(_generate(dev, ids, **kw), ref)


def test_generate_static_cache_compiled_equals_cpu():
    tok, cpu_model = _tok_and_model()
    ids = torch.tensor([tok("a dog ran under")["input_ids"]])
    ref = _generate(cpu_model, ids, do_sample=False)
    dev = tiny_llama.model(tok, seed=3).eval().to("neuron")
    torch._dynamo.reset()
    out = _generate(dev, ids, do_sample=False, cache_implementation="static")
    assert torch.equal(out, ref)
    # generate() compiled the decoding step itself, with backend "neuron" (device type neuron)
    assert dev._default_compile_config().backend == "neuron"
    assert dev._compiled_call is not None


@pytest.mark.parametrize("kw", [dict(device_map="auto", max_memory={0: "2GiB"}),
                                dict(device_map="neuron"), dict(device_map={"": 0})],
                         ids=["auto", "neuron", "index"])
def test_device_map_places_on_neuron(tmp_path, kw):
    # Accelerate's get_max_memory lists only CUDA-like devices, so plain device_map="auto"
    # needs max_memory naming the neuron index (docs/ecosystem.md, known limits).
    tok, cpu_model = _tok_and_model()
    cpu_model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **kw)
    assert {p.device for p in loaded.parameters()} == {torch.device("neuron", 0)}
    ids = torch.tensor([tok("the bird flew")["input_ids"]])
    assert torch.equal(_generate(loaded.eval(), ids, do_sample=False),
                       _generate(cpu_model, ids, do_sample=False))
