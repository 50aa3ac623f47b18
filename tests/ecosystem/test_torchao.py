"""TorchAO 0.18 on neuron, unchanged: float8 and MXFP8 training of the tiny Llama equal the
same recipe on CPU step for step; weight-only int8/float8 and emulated MX inference generate
what CPU generates; what torchao refuses off CUDA is refused alike. docs/precision.md#torchao."""
from __future__ import annotations

import functools

import pytest
import torch

torchao = pytest.importorskip("torchao")
pytest.importorskip("transformers")

import tiny_llama  # noqa: E402  (examples/ is on sys.path: conftest)
import torch_neuronx  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.prototype.moe_training.config import (  # noqa: E402
    MXFP8TrainingOpConfig, MXFP8TrainingRecipe)
from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor  # noqa: E402
from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig  # noqa: E402
from torchao.quantization import (  # noqa: E402
    Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, Int8WeightOnlyConfig,
    quantize_)
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

STEPS = 4
BF16_RTOL = 2e-2   # the tolerance test_hf_transformers.py gives bf16 against fp32


def _not_output(module, fqn: str) -> bool:
    # The output projection stays in high precision, as TorchTitan's converters leave it.
    return isinstance(module, torch.nn.Linear) and fqn != "lm_head"


def _float8(recipe):
    def convert(model):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=_not_output)
    return convert


def _mxfp8(recipe):
    def convert(model):
        quantize_(model, MXFP8TrainingOpConfig.from_recipe(recipe), filter_fn=_not_output)
    return convert


CONVERTERS = {
    "bf16": None,
    "float8_tensorwise": _float8("tensorwise"),
    "float8_rowwise": _float8("rowwise"),
    "mxfp8_emulated": _mxfp8(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
}


@functools.lru_cache(maxsize=None)
def _tok():
    return tiny_llama.tokenizer()


@functools.lru_cache(maxsize=None)
def _batches():
    rows = tiny_llama.Examples(_tok(), seq_len=32).rows
    return tuple(rows[4 * i:4 * (i + 1)] for i in range(STEPS))   # 128 tokens: MX's 32 | M


def _train(device: str, recipe: str, dtype=torch.bfloat16, autocast: bool = False):
    model = tiny_llama.model(_tok(), seed=0).to(device=device, dtype=dtype)
    if CONVERTERS[recipe] is not None:
        CONVERTERS[recipe](model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _batches():
        batch = batch.to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@functools.lru_cache(maxsize=None)
def _cpu_train(recipe: str, dtype=torch.bfloat16, autocast: bool = False):
    losses, model = _train("cpu", recipe, dtype, autocast)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model, ref: dict):
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), ref[k]), k


@pytest.mark.parametrize("recipe", ["float8_tensorwise", "float8_rowwise", "mxfp8_emulated"])
def test_low_precision_training_equals_cpu_and_tracks_bf16(recipe):
    ref_losses, ref_state = _cpu_train(recipe)
    bf16_losses, _ = _cpu_train("bf16")
    torch_neuronx.reset_modelled_time()
    losses, model = _train("neuron", recipe)
    by_op = torch_neuronx.modelled_time().by_op
    if recipe.startswith("float8"):
        assert isinstance(model.model.layers[0].mlp.up_proj, Float8Linear)
        assert "_scaled_mm" in by_op, sorted(by_op)    # the fp8 matmuls ran on the device
    else:
        weight = model.model.layers[0].mlp.up_proj.weight
        assert isinstance(weight.data, MXFP8TrainingWeightWrapperTensor), type(weight.data)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, Float8Linear)
    assert losses == ref_losses
    _same_state(model, ref_state)
    assert losses == pytest.approx(bf16_losses, rel=BF16_RTOL)
    assert losses != bf16_losses     # the low-precision matmuls really replaced bf16 ones


def test_float8_linear_under_neuron_autocast():
    """Float8Linear reads CUDA's autocast state (``torch.is_autocast_enabled()`` without a
    device), so under neuron's autocast, as under CPU's, it quantizes the fp32 activation
    itself; autocast then casts the float8 operands' high-precision dtype to bf16, so the
    module still returns bf16 and trains; the steps equal the same run on CPU."""
    outputs = []
    model = tiny_llama.model(_tok(), seed=0).to("neuron")
    CONVERTERS["float8_rowwise"](model)
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: outputs.append(o))
    with torch.autocast("neuron", dtype=torch.bfloat16):
        assert not torch.is_autocast_enabled()       # the no-device form answers for CUDA
        batch = _batches()[0].to("neuron")
        model(input_ids=batch, labels=batch).loss.backward()
    assert outputs[0].dtype == torch.bfloat16 and outputs[0].device.type == "neuron"
    assert model.model.layers[0].mlp.up_proj.weight.grad.dtype == torch.float32

    for recipe in ("float8_tensorwise", "float8_rowwise"):
        ref_losses, ref_state = _cpu_train(recipe, torch.float32, autocast=True)
        losses, model = _train("neuron", recipe, torch.float32, autocast=True)
        assert losses == ref_losses, recipe
        _same_state(model, ref_state)
        plain, _ = _cpu_train("bf16", torch.float32, autocast=True)
        assert losses == pytest.approx(plain, rel=BF16_RTOL)


@functools.lru_cache(maxsize=None)
def _prompt():
    return _tok()(["the cat sat on", "a big red dog ran"], return_tensors="pt", padding=True,
                  padding_side="left")


def _infer(model, device):
    prompt = {k: v.to(device) for k, v in _prompt().items()}
    with torch.no_grad():
        logits = model(**prompt).logits
        tokens = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    return logits.cpu(), tokens.cpu()


def _quantized(device, quantize, quantize_on_cpu=False):
    model = tiny_llama.model(_tok(), seed=3).eval().to(torch.bfloat16)
    if quantize_on_cpu:
        quantize(model)
        return model.to(device)
    model = model.to(device)
    quantize(model)
    return model


INFERENCE = {
    "int8_weight_only": lambda m: quantize_(m, Int8WeightOnlyConfig()),
    "float8_weight_only": lambda m: quantize_(m, Float8WeightOnlyConfig()),
    "mxfp8_emulated": lambda m: quantize_(m, MXDynamicActivationMXWeightConfig(
        activation_dtype=torch.float8_e4m3fn, weight_dtype=torch.float8_e4m3fn,
        kernel_preference=KernelPreference.EMULATED), filter_fn=_not_output),
    "mxfp4_emulated": lambda m: quantize_(m, MXDynamicActivationMXWeightConfig(
        activation_dtype=torch.float4_e2m1fn_x2, weight_dtype=torch.float4_e2m1fn_x2,
        kernel_preference=KernelPreference.EMULATED), filter_fn=_not_output),
    # Float8DynamicActivationFloat8WeightConfig's neuron equivalent: the training modules
    # quantize activations and weights dynamically through torch._scaled_mm.
    "float8_dynamic_via_training_tensorwise": _float8("tensorwise"),
    "float8_dynamic_via_training_rowwise": _float8("rowwise"),
}


@pytest.mark.parametrize("name", sorted(INFERENCE))
def test_quantized_inference_generates_as_cpu(name):
    quantize = INFERENCE[name]
    ref_logits, ref_tokens = _infer(_quantized("cpu", quantize), "cpu")
    plain_logits, _ = _infer(tiny_llama.model(_tok(), seed=3).eval().to(torch.bfloat16), "cpu")
    model = _quantized("neuron", quantize)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.device.type == "neuron"
    for inner in weight.__tensor_flatten__()[0] if hasattr(weight, "__tensor_flatten__") else ():
        assert getattr(weight, inner).device.type == "neuron", inner
    logits, tokens = _infer(model, "neuron")
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    assert not torch.equal(logits, plain_logits)    # quantization took effect


@pytest.mark.parametrize("name", ["int8_weight_only", "float8_weight_only"])
def test_quantized_on_cpu_then_moved(name):
    ref_logits, ref_tokens = _infer(_quantized("cpu", INFERENCE[name]), "cpu")
    model = _quantized("neuron", INFERENCE[name], quantize_on_cpu=True)
    assert model.model.layers[0].mlp.up_proj.weight.qdata.device.type == "neuron"
    logits, tokens = _infer(model, "neuron")
    assert torch.equal(logits, ref_logits) and torch.equal(tokens, ref_tokens)


def test_refused_off_cuda_alike():
    """torchao checks the host's GPU, not the model's device: these refuse on CPU too."""
    model = tiny_llama.model(_tok(), seed=3).eval().to(torch.bfloat16).to("neuron")
    with pytest.raises(AssertionError, match="requires CUDA compute capability"):
        quantize_(model, Float8DynamicActivationFloat8WeightConfig())
    model = tiny_llama.model(_tok(), seed=0).to(torch.bfloat16).to("neuron")
    _mxfp8(MXFP8TrainingRecipe.MXFP8_RCEIL)(model)     # AUTO kernels: Triton/CUDA casts
    batch = _batches()[0].to("neuron")
    with pytest.raises(AssertionError, match="needs triton"):
        model(input_ids=batch, labels=batch)
