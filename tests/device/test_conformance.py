"""CUDA conformance of the neuron device: what a CUDA-tested program reaches.

RNG: as on CUDA, ``torch.manual_seed`` seeds CPU and every device generator, and
``torch.neuron.manual_seed`` only the device's. The device generator is CPU's Mersenne
Twister, so under the same seed a neuron random op gives CPU's numbers (compared against
the CPU op), and a neuron random op never advances CPU's stream.

API names: every public name of ``torch.cuda`` and ``torch.cuda.memory`` in the installed
torch has a ``torch.neuron`` counterpart, or is listed below with why it has no meaning here.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_neuronx  # noqa: F401

DEV = "neuron"

# torch.cuda names with no counterpart, and why. A new torch.cuda name fails the walk until
# it is given a counterpart or a reason here.
_CUDA_ONLY = {
    **{n: "legacy typed tensor/storage classes; use torch.tensor(..., device='neuron')"
       for n in ("BFloat16Storage", "BFloat16Tensor", "BoolStorage", "BoolTensor", "ByteStorage",
                 "ByteTensor", "CharStorage", "CharTensor", "ComplexDoubleStorage",
                 "ComplexFloatStorage", "DoubleStorage", "DoubleTensor", "FloatStorage",
                 "FloatTensor", "HalfStorage", "HalfTensor", "IntStorage", "IntTensor",
                 "LongStorage", "LongTensor", "ShortStorage", "ShortTensor")},
    "CUDAGraph": "torch.neuron.NeuronGraph (a torch.accelerator.Graph) is the counterpart",
    **{n: "pluggable/caching allocator internals and memory pools of the CUDA caching allocator"
       for n in ("CUDAPluggableAllocator", "MemPool", "caching_allocator_disabled",
                 "caching_allocator_enable", "change_current_allocator", "get_allocator_backend",
                 "use_mem_pool")},
    **{n: "pinned host-allocator statistics of CUDA's host caching allocator"
       for n in ("host_memory_stats", "host_memory_stats_as_nested_dict",
                 "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats")},
    **{n: "CUDA runtime/driver handles and errors"
       for n in ("CudaError", "DeferredCudaCallError", "ExternalStream", "GreenContext",
                 "check_error", "cudaStatus", "cudart", "current_blas_handle",
                 "current_solver_handle", "get_stream_from_external", "get_gencode_flags",
                 "ipc_collect", "has_half", "has_magma")},
    **{n: "NVML telemetry of a physical GPU; the virtual core has none"
       for n in ("clock_rate", "list_gpu_processes", "memory_usage",
                 "power_draw", "temperature", "utilization")},
    **{n: "CUDA-specific submodule (NVTX, NCCL, jiterator, TunableOp, cuSPARSE, profiler); "
          "torch.profiler covers the device"
       for n in ("jiterator", "nccl", "nvtx", "profiler", "sparse", "tunable")},
}


def _public(obj):
    return {n for n in dir(obj) if not n.startswith("_")}


@pytest.mark.parametrize("module", ["torch.cuda", "torch.cuda.memory"])
def test_every_cuda_name_has_a_counterpart_or_a_reason(module):
    names = set(eval(module).__all__)
    missing = sorted(n for n in names - set(_CUDA_ONLY) if not hasattr(torch.neuron, n))
    assert not missing, f"{module} names without a torch.neuron counterpart: {missing}"
    stale = sorted(n for n in _CUDA_ONLY if n in names and hasattr(torch.neuron, n))
    assert not stale, f"listed as CUDA-only but torch.neuron has them: {stale}"


def test_torch_neuron_memory_holds_what_torch_cuda_memory_does():
    missing = sorted(n for n in torch.cuda.memory.__all__
                     if hasattr(torch.neuron, n) and not hasattr(torch.neuron.memory, n))
    assert not missing, missing
    assert torch.neuron.memory.memory_stats_as_nested_dict is torch.neuron.memory_stats_as_nested_dict


def test_submodules_import_as_cuda_s_do():
    # `import torch.cuda.memory` works; the same spelling finds torch.neuron's own modules
    import importlib
    for name in ("memory", "random", "streams", "graphs", "amp", "comm"):
        mod = importlib.import_module(f"torch.neuron.{name}")
        assert mod is getattr(torch.neuron, name)
    import torch.neuron.memory as memory
    memory.set_per_process_memory_fraction(0.5)
    try:
        assert torch.neuron.get_per_process_memory_fraction() == 0.5
    finally:
        memory.set_per_process_memory_fraction(1.0)


def test_cuda_amp_spellings_warn_and_are_torch_amp_on_neuron():
    m = torch.nn.Linear(8, 4).to(DEV)
    x = torch.randn(2, 8, device=DEV)
    with pytest.warns(FutureWarning, match="torch.amp.autocast"):
        ctx = torch.neuron.amp.autocast()
    with ctx:
        y = m(x)
    with torch.autocast(DEV):
        want = m(x)
    assert y.dtype == want.dtype == torch.bfloat16 and torch.equal(y, want)
    with pytest.warns(FutureWarning, match="torch.amp.GradScaler"):
        scaler = torch.neuron.amp.GradScaler(init_scale=8.0)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 8.0
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler.scale(m(x).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0       # finite grads: no backoff, growth after 2000 steps

    with pytest.warns(FutureWarning):
        class Square(torch.autograd.Function):
            @staticmethod
            @torch.neuron.amp.custom_fwd(cast_inputs=torch.float32)
            def forward(ctx, a):
                ctx.save_for_backward(a)
                return a * a

            @staticmethod
            @torch.neuron.amp.custom_bwd
            def backward(ctx, g):
                (a,) = ctx.saved_tensors
                return 2 * a * g
    a = torch.randn(4, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast(DEV):
        out = Square.apply(a)
    assert out.dtype == torch.float32      # cast_inputs ran forward in fp32 under autocast
    out.sum().backward()
    assert a.grad is not None


def test_caching_allocator_alloc_and_delete():
    torch.neuron.synchronize()
    before = torch.neuron.memory_allocated()
    ptr = torch.neuron.caching_allocator_alloc(1 << 20)
    assert ptr != 0 and torch.neuron.memory_allocated() - before >= 1 << 20
    s = torch.neuron.Stream()
    ptr2 = torch.neuron.caching_allocator_alloc(4096, stream=s)
    torch.neuron.caching_allocator_delete(ptr)
    torch.neuron.caching_allocator_delete(ptr2)
    assert torch.neuron.memory_allocated() == before
    assert torch.neuron.caching_allocator_alloc(0) == 0
    torch.neuron.caching_allocator_delete(0)
    with pytest.raises(RuntimeError, match="not an address caching_allocator_alloc returned"):
        torch.neuron.caching_allocator_delete(ptr)
    with pytest.raises(TypeError, match="byte count"):
        torch.neuron.caching_allocator_alloc(-1)
    free, total = torch.neuron.mem_get_info()
    assert torch.neuron.device_memory_used() == total - free
    assert torch.neuron.OutOfMemoryError is torch.OutOfMemoryError


def test_stream_and_event_methods_match_cuda():
    s = torch.neuron.Stream()
    e = torch.neuron.Event(enable_timing=True)
    for cls, obj in ((torch.cuda.Stream, s), (torch.cuda.Event, e)):
        ipc = {"ipc_handle", "from_ipc_handle"}  # CUDA IPC handles: no cross-process device
        missing = sorted(n for n in _public(cls) - ipc if not hasattr(obj, n))
        assert not missing, f"{cls.__name__} methods missing on neuron: {missing}"
    e.record(s)
    s.synchronize()
    assert e.query() and s.query()
    e2 = torch.neuron.Event(enable_timing=True)
    e2.record(s)
    e2.synchronize()
    assert e.elapsed_time(e2) >= 0


def test_deprecated_memory_aliases_equal_current_names():
    x = torch.empty(1 << 16, device=DEV)
    with pytest.warns(FutureWarning):
        assert torch.neuron.memory_cached() == torch.neuron.memory_reserved()
    with pytest.warns(FutureWarning):
        assert torch.neuron.max_memory_cached() == torch.neuron.max_memory_reserved()
    with pytest.warns(FutureWarning):
        torch.neuron.reset_max_memory_allocated()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
    del x


def test_memory_stats_as_nested_dict_holds_the_flat_stats():
    torch.empty(1024, device=DEV)
    flat = torch.neuron.memory_stats()
    nested = torch.neuron.memory_stats_as_nested_dict()
    for key, value in flat.items():
        node = nested
        for part in key.split("."):
            node = node[part]
        assert node == value, key


def test_per_process_memory_fraction_round_trips():
    try:
        torch.neuron.set_per_process_memory_fraction(0.5)
        assert torch.neuron.get_per_process_memory_fraction() == 0.5
    finally:
        torch.neuron.set_per_process_memory_fraction(1.0)
    assert torch.neuron.get_per_process_memory_fraction() == 1.0


def test_peer_access_capture_arch_tf32():
    n = torch.neuron.device_count()
    assert torch.neuron.can_device_access_peer(0, 0) is False  # as CUDA: not with itself
    if n > 1:
        assert torch.neuron.can_device_access_peer(0, 1) is True
    with pytest.raises(RuntimeError, match="Invalid device index"):
        torch.neuron.can_device_access_peer(0, n)
    assert torch.neuron.is_current_stream_capturing() is False
    assert torch.neuron.get_arch_list() == [torch.neuron.get_device_properties().core_version]
    assert torch.neuron.is_tf32_supported() is False


def test_sync_debug_mode_is_stored_like_cuda():
    try:
        torch.neuron.set_sync_debug_mode("warn")
        assert torch.neuron.get_sync_debug_mode() == 1
        torch.neuron.set_sync_debug_mode(2)
        assert torch.neuron.get_sync_debug_mode() == 2
        with pytest.raises(RuntimeError, match="debug_mode"):
            torch.neuron.set_sync_debug_mode("loud")
    finally:
        torch.neuron.set_sync_debug_mode(0)


def test_default_generators_are_the_device_generators():
    gens = torch.neuron.default_generators
    assert len(gens) == torch.neuron.device_count()
    assert gens[0] is torch.neuron.default_generator(0)
    assert gens[0].device == torch.device(DEV, 0)
    with pytest.raises(IndexError):
        gens[len(gens)]


# --- RNG: random ops draw from the device generator ---------------------------------------

def _dropout_cases():
    return [
        ("F.dropout", lambda x: F.dropout(x, 0.3, training=True)),
        ("native_dropout", lambda x: torch.native_dropout(x, 0.3, True)[0]),
        ("nn.Dropout", lambda x: torch.nn.Dropout(0.5).train()(x)),
        ("dropout p=0", lambda x: F.dropout(x, 0.0, training=True)),
        ("dropout p=1", lambda x: F.dropout(x, 1.0, training=True)),
        ("bernoulli", lambda x: torch.bernoulli(x.sigmoid())),
        ("rand_like", lambda x: torch.rand_like(x)),
    ]


@pytest.mark.parametrize("name,fn", _dropout_cases(), ids=[c[0] for c in _dropout_cases()])
def test_random_op_same_seed_gives_cpu_numbers(name, fn):
    x = torch.randn(4, 33)
    torch.manual_seed(7)
    want = fn(x)
    torch.manual_seed(7)
    got = fn(x.to(DEV))
    assert got.device.type == DEV
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("name,fn", _dropout_cases(), ids=[c[0] for c in _dropout_cases()])
def test_random_op_draws_from_neuron_generator_only(name, fn):
    x = torch.randn(4, 33, device=DEV)
    cpu_state = torch.get_rng_state()
    dev_state = torch.neuron.get_rng_state()
    fn(x)
    assert torch.equal(torch.get_rng_state(), cpu_state), f"{name} advanced the CPU generator"
    if name not in ("dropout p=0", "dropout p=1"):
        assert not torch.equal(torch.neuron.get_rng_state(), dev_state), \
            f"{name} did not advance the neuron generator"


def test_neuron_manual_seed_reaches_dropout_and_not_cpu():
    x = torch.ones(256, device=DEV)
    torch.neuron.manual_seed(3)
    a = F.dropout(x, 0.5)
    torch.manual_seed(99)  # reseeds the device too, as on CUDA
    torch.neuron.manual_seed(3)
    b = F.dropout(x, 0.5)
    assert torch.equal(a.cpu(), b.cpu())
    torch.neuron.manual_seed(4)
    assert not torch.equal(F.dropout(x, 0.5).cpu(), a.cpu())
    torch.manual_seed(5)
    cpu_before = torch.rand(3)
    torch.manual_seed(5)
    torch.neuron.manual_seed(6)
    assert torch.equal(torch.rand(3), cpu_before)  # device seeding left CPU alone


def test_dropout_trains_like_cpu():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.25), torch.nn.Linear(16, 4))
    dev = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.25), torch.nn.Linear(16, 4))
    dev.load_state_dict(ref.state_dict())
    dev.to(DEV)
    x = torch.randn(5, 8)
    torch.manual_seed(11)
    ref(x).square().sum().backward()
    torch.manual_seed(11)
    dev(x.to(DEV)).square().sum().backward()
    for p, q in zip(ref.parameters(), dev.parameters()):
        assert torch.equal(q.grad.cpu(), p.grad)


def _layout(x, kind):
    return {"contiguous": x, "transposed": x.t(),
            "permuted": x.reshape(4, 6, 8).permute(2, 0, 1)}[kind]


@pytest.mark.parametrize("kind", ["contiguous", "transposed", "permuted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.123, 0.5, 0.7])
def test_dropout_equals_cpu_bit_for_bit(p, dtype, kind):
    # F.dropout on the CPU is ATen's composite (input * noise / (1 - p), the noise in the
    # input's layout), not native_dropout: neuron computes the same, forward and backward
    x = torch.randn(24, 8).to(dtype)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    x = _layout(x, kind)
    g = torch.randn_like(x)
    got, want = [], []
    for device, out in (("cpu", want), (DEV, got)):
        xi = x.detach().to(device).requires_grad_()
        torch.manual_seed(7)
        y = F.dropout(xi, p)
        y.backward(g.to(device))
        inplace = x.to(device).clone()
        torch.manual_seed(7)
        F.dropout(inplace, p, inplace=True)
        out += [y.detach().cpu(), xi.grad.cpu(), inplace.cpu()]
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    for w, o in zip(want, got):   # bit for bit: NaN payloads and signed zeros too
        assert torch.equal(o.view(bits[dtype]), w.view(bits[dtype]))
    torch.manual_seed(7)
    out, mask = torch.native_dropout(x, p, True)   # called directly: CPU's fused kernel
    torch.manual_seed(7)
    dout, dmask = torch.native_dropout(x.to(DEV), p, True)
    assert torch.equal(dout.cpu().view(bits[dtype]), out.view(bits[dtype]))
    assert torch.equal(dmask.cpu(), mask)


def test_dropout_eval_and_empty():
    x = torch.randn(3, 4, device=DEV)
    out, mask = torch.native_dropout(x, 0.5, False)
    assert torch.equal(out.cpu(), x.cpu()) and mask.dtype == torch.bool and bool(mask.all())
    e = torch.empty(0, 4, device=DEV)
    out, mask = torch.native_dropout(e, 0.5, True)
    want_out, want_mask = torch.native_dropout(e.cpu(), 0.5, True)
    assert out.shape == want_out.shape and mask.dtype == want_mask.dtype


@pytest.mark.parametrize("call", [
    lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.quint8),
    lambda x: torch.quantize_per_tensor_dynamic(x, torch.quint8, False),
    lambda x: torch.quantize_per_channel(x, torch.ones(4, device=DEV), torch.zeros(4, dtype=torch.long, device=DEV), 0, torch.qint8),
], ids=["per_tensor", "dynamic", "per_channel"])
def test_quantize_names_the_op_and_device_stays_usable(call):
    x = torch.randn(4, 3, device=DEV)
    with pytest.raises(NotImplementedError, match=r"aten::quantize_per_\w+ is not supported on the neuron device"):
        call(x)
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)


# --- RNN modules: off the CPU they call the fused cells CUDA has -------------------------

@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("layers,bidirectional,batch_first,packed", [
    (1, False, False, False), (2, False, True, False), (2, True, False, False),
    (1, True, True, True), (2, False, False, True)])
def test_rnn_trains_like_cpu(kind, layers, bidirectional, batch_first, packed):
    torch.manual_seed(0)
    ref = getattr(torch.nn, kind)(5, 7, num_layers=layers, bidirectional=bidirectional,
                                  batch_first=batch_first)
    dev = getattr(torch.nn, kind)(5, 7, num_layers=layers, bidirectional=bidirectional,
                                  batch_first=batch_first)
    dev.load_state_dict(ref.state_dict())
    dev.to(DEV)
    x = torch.randn((3, 4, 5) if batch_first else (4, 3, 5))
    lengths = torch.tensor([4, 3, 2])

    def run(model, inp):
        if packed:
            inp = torch.nn.utils.rnn.pack_padded_sequence(inp, lengths, batch_first=batch_first)
        out, _ = model(inp)
        if packed:
            out = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first)[0]
        return out

    want = run(ref, x)
    got = run(dev, x.to(DEV))
    torch.testing.assert_close(got.cpu(), want)
    want.square().sum().backward()
    got.square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), dev.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, msg=name)


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell"])
@pytest.mark.parametrize("bias", [True, False])
def test_rnn_cell_grads_like_cpu(cell, bias):
    torch.manual_seed(1)
    ref = getattr(torch.nn, cell)(6, 4, bias=bias)
    dev = getattr(torch.nn, cell)(6, 4, bias=bias)
    dev.load_state_dict(ref.state_dict())
    dev.to(DEV)
    x = torch.randn(3, 6, requires_grad=True)
    xd = x.detach().to(DEV).requires_grad_()
    want, got = ref(x), dev(xd)
    want = want[0] + 2 * want[1] if cell == "LSTMCell" else want
    got = got[0] + 2 * got[1] if cell == "LSTMCell" else got
    torch.testing.assert_close(got.cpu(), want)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
    for p, q in zip(ref.parameters(), dev.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad)
