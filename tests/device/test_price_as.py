"""torch_neuronx.price_as: work executed in fp32 charged as the same work in bf16.

The reference is the bf16 run itself: the modelled time of a step executed in bf16 must equal
that of the same step executed in fp32 inside ``price_as(torch.bfloat16)``. Adaptive Eager is
off in both, since it fuses fp32 chains that it runs op by op in bf16 (documented)."""
import pytest
import torch
import torch.nn.functional as F

import torch_neuronx

DEV = "neuron"


@pytest.fixture(autouse=True)
def _op_by_op():
    was = torch_neuronx.is_adaptive_eager_enabled()
    torch_neuronx.set_adaptive_eager(False)
    torch_neuronx.reset_modelled_time()
    yield
    torch_neuronx.set_adaptive_eager(was)
    torch_neuronx.reset_modelled_time()


def _mlp_step(dtype, compiled):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 384, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(384, 96, bias=False)).to(DEV, dtype)
    run = torch.compile(model, backend="neuron") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(200, 96, dtype=dtype).to(DEV)

    def step():
        run(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.neuron.synchronize()
    step()  # warm-up, compilation
    torch_neuronx.reset_modelled_time()
    return step


def _modelled(step):
    step()
    return torch_neuronx.modelled_time(reset=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_fp32_step_priced_as_bf16_costs_what_the_bf16_step_costs(compiled):
    bf16 = _modelled(_mlp_step(torch.bfloat16, compiled))
    fp32_step = _mlp_step(torch.float32, compiled)
    fp32 = _modelled(fp32_step)
    with torch_neuronx.price_as(torch.bfloat16):
        fp32_step()
    priced = torch_neuronx.modelled_time(reset=True)
    assert priced.seconds == pytest.approx(bf16.seconds, rel=1e-9)
    assert priced.hbm_bytes == bf16.hbm_bytes
    assert priced.launches == bf16.launches
    assert dict(priced.by_op) == pytest.approx(dict(bf16.by_op), rel=1e-9)
    assert fp32.hbm_bytes > bf16.hbm_bytes and fp32.seconds > bf16.seconds
    # and after the block, fp32 is charged as fp32 again
    assert _modelled(fp32_step).seconds == pytest.approx(fp32.seconds, rel=1e-9)


def test_integer_inputs_keep_their_bytes():
    idx = torch.randint(0, 1000, (64, 32)).to(DEV)
    target = torch.randint(0, 1000, (64 * 32,)).to(DEV)

    def run(dtype):
        w = torch.randn(1000, 48, dtype=dtype).to(DEV)
        head = torch.randn(1000, 48, dtype=dtype).to(DEV)
        torch.neuron.synchronize()
        torch_neuronx.reset_modelled_time()
        h = F.embedding(idx, w).flatten(0, 1)
        F.cross_entropy(h @ head.T, target)
        torch.neuron.synchronize()

    run(torch.bfloat16)
    bf16 = torch_neuronx.modelled_time(reset=True)
    with torch_neuronx.price_as(torch.bfloat16):
        run(torch.float32)
    priced = torch_neuronx.modelled_time(reset=True)
    assert priced.by_op["embedding"] == pytest.approx(bf16.by_op["embedding"], rel=1e-9)
    assert priced.hbm_bytes == bf16.hbm_bytes
    assert priced.seconds == pytest.approx(bf16.seconds, rel=1e-9)


def test_execution_is_unchanged():
    x = torch.randn(64, 64)
    with torch_neuronx.price_as(torch.bfloat16):
        y = (x.to(DEV) @ x.to(DEV)).sin().cpu()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, (x @ x).sin(), rtol=0, atol=0)


def test_refuses_a_non_floating_dtype():
    with pytest.raises(TypeError, match="price_as: torch.int32 is not a floating-point dtype"):
        with torch_neuronx.price_as(torch.int32):
            pass


def test_library_kernel_calls_are_priced_in_the_priced_dtype():
    # rms_norm (charged as NKI-lib's rmsnorm_tkg) and torch._grouped_mm (one grouped matmul)
    # are charged from their tensors, not from the runtime's records
    offs = torch.tensor([64, 160, 256], dtype=torch.int32).to(DEV)

    def run(dtype):
        x = torch.randn(256, 128, dtype=dtype).to(DEV)
        w = torch.randn(128, dtype=dtype).to(DEV)
        experts = torch.randn(3, 128, 64, dtype=dtype).to(DEV)
        torch.neuron.synchronize()
        torch_neuronx.reset_modelled_time()
        F.rms_norm(x, (128,), w, 1e-6)
        torch._grouped_mm(x, experts, offs=offs)
        torch.neuron.synchronize()

    run(torch.bfloat16)
    bf16 = torch_neuronx.modelled_time(reset=True)
    run(torch.float32)
    fp32 = torch_neuronx.modelled_time(reset=True)
    with torch_neuronx.price_as(torch.bfloat16):
        run(torch.float32)
    priced = torch_neuronx.modelled_time(reset=True)
    for op in ("rms_norm", "_grouped_mm"):
        assert priced.by_op[op] == pytest.approx(bf16.by_op[op], rel=1e-9), op
        assert fp32.by_op[op] != pytest.approx(bf16.by_op[op], rel=1e-3), op
    assert priced.hbm_bytes == bf16.hbm_bytes


def test_the_pricing_ends_with_the_block_even_when_it_raises():
    x = torch.randn(64, 64).to(DEV)
    with pytest.raises(RuntimeError, match="boom"):
        with torch_neuronx.price_as(torch.bfloat16):
            raise RuntimeError("boom")
    torch_neuronx.reset_modelled_time()
    (x @ x).sum().item()
    plain = torch_neuronx.modelled_time(reset=True)
    with torch_neuronx.price_as(torch.bfloat16):
        (x @ x).sum().item()
    priced = torch_neuronx.modelled_time(reset=True)
    assert plain.hbm_bytes == 2 * priced.hbm_bytes
