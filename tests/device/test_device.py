"""The device itself: configuration, memory, RNG, streams, integration, bad input."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings

import pytest
import torch

import torch_neuronx

N = "neuron"


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=120)


# ---------------------------------------------------------------- devices and configuration

def test_default_is_one_trn2_chip_at_lnc2():
    assert torch.neuron.is_available()
    assert torch.neuron.device_count() == 4
    assert torch.accelerator.device_count() == 4
    # AWS's names: "neuron", and the platform type as the properties' name
    assert torch.neuron.get_device_name() == "neuron"
    props = torch.neuron.get_device_properties(0)
    assert props.name == "trn2" and props.chip == "Trainium2" and props.is_virtual
    assert torch.neuron._describe() == "Trainium2 NeuronCore-v3 (virtual, LNC=2)"
    assert props.total_memory == 24 * 2**30 or os.environ.get("TORCH_NEURONX_HBM_BYTES")
    assert props.peak_tflops["bfloat16"] == pytest.approx(158.0)
    assert props.logical_nc_config == 2


@pytest.mark.parametrize("env,count,name", [
    ({"NEURON_RT_VISIBLE_CORES": "0-1"}, 2, "Trainium2"),
    ({"NEURON_RT_NUM_CORES": "3"}, 3, "Trainium2"),
    ({"NEURON_LOGICAL_NC_CONFIG": "1"}, 8, "Trainium2"),
    ({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"}, 4, "Trainium3"),
    ({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn1"}, 2, "Trainium1"),
    ({"NEURON_RT_VISIBLE_CORES": "0,2,5"}, 3, "Trainium2"),
])
def test_environment_selects_devices(env, count, name):
    r = _run("import torch; print(torch.neuron.device_count(), torch.neuron._describe(),"
             " torch.neuron.get_device_properties(0).total_memory)",
             TORCH_NEURONX_HBM_BYTES="", **env)
    assert r.returncode == 0, r.stderr
    n, rest = r.stdout.split(" ", 1)
    assert int(n) == count and rest.startswith(name)


def test_trn3_hbm_per_logical_core():
    r = _run("import torch; print(torch.neuron.get_device_properties(0).total_memory)",
             NEURON_PLATFORM_TARGET_OVERRIDE="trn3", TORCH_NEURONX_HBM_BYTES="")
    assert int(r.stdout) == 144 * 2**30 // 4


@pytest.mark.parametrize("env,needle", [
    ({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn9"}, "unknown Neuron platform target"),
    ({"NEURON_LOGICAL_NC_CONFIG": "3"}, "NEURON_LOGICAL_NC_CONFIG"),
    ({"NEURON_RT_VISIBLE_CORES": "a-b"}, "NEURON_RT_VISIBLE_CORES"),
])
def test_bad_environment_is_named(env, needle):
    r = _run("import torch", **env)
    assert r.returncode != 0 and needle in r.stderr


def test_autoload_can_be_disabled():
    r = _run("import torch; print(hasattr(torch, 'neuron'))", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert r.stdout.strip() == "False"


def test_device_context_and_set_device():
    assert torch.neuron.current_device() == 0
    with torch.neuron.device(2):
        assert torch.neuron.current_device() == 2
        assert torch.empty(1, device=N).device == torch.device(N, 2)
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device(1)
    try:
        assert torch.randn(2, device=N).device.index == 1
    finally:
        torch.neuron.set_device(0)


def test_invalid_device_index_is_clear_and_recoverable():
    with pytest.raises(RuntimeError, match=r"Invalid device index neuron:9.*4 visible"):
        torch.empty(2, device="neuron:9")
    with pytest.raises(RuntimeError, match="Invalid device index"):
        torch.neuron.set_device(7)
    assert (torch.ones(2, device=N) + 1).sum().item() == 4


def test_unknown_device_string():
    with pytest.raises(RuntimeError, match="neuronx"):
        torch.device("neuronx")


def test_cli_ls():
    from torch_neuronx.cli import main
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["ls"]) == 0
    out = buf.getvalue()
    assert "neuron:3" in out and "trn2" in out and "24.0 GiB" in out or "GiB" in out


# ---------------------------------------------------------------- tensors, copies, errors

def test_copies_between_host_and_devices():
    x = torch.randn(5, 7)
    a = x.to(N)
    b = a.to("neuron:1")
    c = b.to("neuron:3").t().contiguous().t()
    assert b.device.index == 1 and c.device.index == 3
    torch.testing.assert_close(c.cpu(), x, rtol=0, atol=0)
    assert a.is_neuron and not x.is_neuron
    assert torch.equal(a.to(torch.float16).cpu(), x.to(torch.float16))


def test_cross_device_op_raises_cuda_error():
    a = torch.ones(3, device=N)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*neuron:0 and cpu"):
        a + torch.ones(3)
    with pytest.raises(RuntimeError, match="neuron:0 and neuron:1"):
        a + torch.ones(3, device="neuron:1")
    assert (a + torch.tensor(2.0)).sum().item() == 9  # CPU scalars are allowed, as on CUDA
    assert (a * 2).sum().item() == 6


@pytest.mark.parametrize("call", [
    lambda a, c: torch.cat([a, c]),
    lambda a, c: torch.stack([a, c]),
    lambda a, c: torch.hstack([a, c]),
    lambda a, c: torch._foreach_mul_([a.view(3)], [c.view(3)]),
    lambda a, c: torch._foreach_addcmul([a.view(3)], [c.view(3)], [a.view(3)]),
], ids=["cat", "stack", "hstack", "foreach_mul_", "foreach_addcmul"])
def test_host_tensor_in_a_list_raises_cuda_error(call):
    a, c = torch.ones(1, 1, 3, device=N), torch.ones(1, 1, 3)
    for _ in range(3):   # the first call of a signature and the queued ones alike
        with pytest.raises(RuntimeError, match="same device.*neuron:0 and cpu"):
            call(a, c)
    assert torch.equal(torch.cat([a, a]).cpu(), torch.ones(2, 1, 3))


def test_host_index_lists_and_foreach_scalars_stay_allowed():
    x = torch.arange(10.0, device=N)
    idx = torch.tensor([1, 3])
    assert torch.equal(x[idx].cpu(), torch.tensor([1.0, 3.0]))     # host indices, as on CUDA
    x.index_put_((idx,), torch.tensor(0.0, device=N))
    assert x[1].item() == 0.0
    ts = [torch.ones(2, device=N), torch.ones(2, device=N)]
    torch._foreach_addcmul_(ts, ts, ts, torch.tensor([2.0, 3.0]))   # CUDA's host `scalars`
    assert ts[1].cpu().tolist() == [4.0, 4.0]
    torch._foreach_mul_(ts, torch.tensor(0.5))                        # a host 0-d tensor
    assert ts[0].cpu().tolist() == [1.5, 1.5]


def test_convolution_checks_its_parameters_device():
    x = torch.ones(1, 1, 5, device=N)
    with pytest.raises(RuntimeError, match=r"Input type \(torch.neuron.FloatTensor\) and "
                                           r"weight type \(torch.FloatTensor\)"):
        torch.nn.functional.conv1d(x, torch.ones(1, 1, 3))
    with pytest.raises(RuntimeError, match="bias type"):
        torch.nn.functional.conv1d(x, torch.ones(1, 1, 3, device=N), torch.ones(1))
    with pytest.raises(RuntimeError, match="neuron:0 and neuron:1"):
        torch.nn.functional.conv1d(x, torch.ones(1, 1, 3, device="neuron:1"))
    with pytest.raises(RuntimeError, match="weight type"):
        torch.nn.Conv2d(1, 1, 1)(torch.ones(1, 1, 2, 2, device=N))   # the module left on the CPU
    with pytest.raises(RuntimeError, match="weight type"):
        torch.nn.functional.conv_transpose1d(x, torch.ones(1, 1, 3))
    assert torch.nn.functional.conv1d(x, torch.ones(1, 1, 3, device=N)).sum().item() == 9.0


def test_a_host_generator_on_a_device_op_raises_cuda_error():
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator but "
                                           "found 'cpu'"):
        torch.rand(2, device=N, generator=torch.Generator())
    g = torch.Generator(N).manual_seed(1)
    a = torch.rand(3, device=N, generator=g)
    torch.manual_seed(1)
    assert torch.equal(a.cpu(), torch.rand(3))
    # AWS's converse, which diffusers' randn_tensor relies on: a neuron generator drives a
    # host op (latents drawn on the CPU) and advances
    g.manual_seed(2)
    host = torch.randn(4, generator=g)
    assert host.device.type == "cpu" and g.get_offset() > 0
    assert torch.equal(host, torch.randn(4, generator=torch.Generator().manual_seed(2)))


def test_deterministic_mode_fills_new_memory_as_cpu_does():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.bool):
            for make in (lambda d: torch.empty(3, 4, dtype=dtype, device=d),
                         lambda d: torch.empty_strided((3, 4), (1, 3), dtype=dtype, device=d),
                         lambda d: torch.ones(2, dtype=dtype, device=d).new_empty(5)):
                want, got = make("cpu"), make(N).cpu()
                assert torch.equal(got.isnan() if dtype.is_floating_point else got,
                                   want.isnan() if dtype.is_floating_point else want)
        r = torch.zeros(2, device=N)
        r.resize_(6)
        w = torch.zeros(2)
        w.resize_(6)
        assert torch.equal(r.cpu().isnan(), w.isnan()) and r[:2].cpu().tolist() == [0.0, 0.0]
    finally:
        torch.use_deterministic_algorithms(prev)


def test_views_inplace_and_out():
    x = torch.arange(24.0).reshape(4, 6)
    d = x.to(N)
    v = d[1:, ::2]
    v.mul_(10)
    x[1:, ::2].mul_(10)
    torch.testing.assert_close(d.cpu(), x, rtol=0, atol=0)
    out = torch.empty(0, device=N)
    torch.add(d, 1, out=out)
    assert out.shape == x.shape and torch.equal(out.cpu(), x + 1)
    assert d.t().stride() == (1, 6) and d.unsqueeze(0).expand(3, 4, 6).stride()[0] == 0


def test_dtypes_roundtrip():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
               torch.complex64, torch.float64):
        x = (torch.randn(6) * 3).to(dt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = x.to(N)
            assert y.dtype == dt and torch.equal(y.cpu().view(torch.uint8), x.view(torch.uint8))


def test_float64_warns_once_naming_op():
    x = torch.randn(4, dtype=torch.float64, device=N)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.special.i0e(x)
        torch.special.i0e(x)
    msgs = [str(m.message) for m in w if "i0e" in str(m.message)]
    assert len(msgs) == 1 and "Double" in msgs[0] and "will not port" in msgs[0]


def test_printing_does_not_warn():
    x = torch.randn(3, device=N)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "device='neuron:0'" in repr(x)


def test_fft_linalg_match_cpu():
    x = torch.randn(8, 8)
    d = x.to(N)
    for f in (torch.fft.fft, torch.fft.ifft, torch.fft.rfft, torch.fft.hfft, torch.linalg.inv,
              torch.linalg.qr, torch.linalg.eigh, torch.linalg.svd):
        a, b = f(x @ x.T if f is torch.linalg.eigh else x), f(d @ d.T if f is torch.linalg.eigh else d)
        for u, v in zip(a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b]):
            torch.testing.assert_close(v.cpu(), u, rtol=0, atol=0)


def test_conv_and_autograd_match_cpu():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                            torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 9, 4))
    x = torch.randn(2, 3, 8, 8)
    md = __import__("copy").deepcopy(m).to(N)
    m(x).square().sum().backward()
    md(x.to(N)).square().sum().backward()
    for p, q in zip(m.parameters(), md.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=0, atol=0)


def test_no_kernel_for_dtype_is_clear():
    x = torch.ones(2, 2, dtype=torch.bool, device=N)
    with pytest.raises(RuntimeError, match="Bool|bool"):
        torch.linalg.inv(x)
    assert torch.ones(1, device=N).item() == 1


# ---------------------------------------------------------------- memory

def test_memory_stats_track_allocations():
    torch.neuron.empty_cache()
    base = torch.neuron.memory_allocated()
    x = torch.empty(1 << 20, dtype=torch.uint8, device=N)
    assert torch.neuron.memory_allocated() >= base + (1 << 20)
    assert torch.accelerator.memory_allocated() == torch.neuron.memory_allocated()
    assert torch.neuron.memory_reserved() >= torch.neuron.memory_allocated()
    del x
    assert torch.neuron.memory_allocated() == base
    assert torch.neuron.max_memory_allocated() >= base + (1 << 20)
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == base
    stats = torch.neuron.memory_stats()
    assert "allocated_bytes.all.current" in stats and "num_ooms" in stats
    free, total = torch.neuron.mem_get_info()
    assert total == torch.neuron.get_device_properties(0).total_memory and free <= total
    assert "Allocated memory" in torch.neuron.memory_summary()
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated()


def test_out_of_memory_raises_with_summary_and_recovers():
    total = torch.neuron.get_device_properties(0).total_memory
    with pytest.raises(torch.OutOfMemoryError) as e:
        torch.empty(total + 1, dtype=torch.uint8, device=N)
    msg = str(e.value)
    assert "Neuron out of memory" in msg and "neuron:0" in msg and "modelled HBM" in msg
    assert torch.neuron.memory_stats()["num_ooms"] >= 1
    assert (torch.ones(4, device=N) * 2).sum().item() == 8


def test_oom_from_an_op_output():
    x = torch.ones(1, device=N)
    with pytest.raises(torch.OutOfMemoryError):
        x.expand(torch.neuron.get_device_properties(0).total_memory // 4 + 1).contiguous()
    assert x.item() == 1


def test_per_process_memory_fraction():
    r = _run("import torch\n"
             "torch.neuron.set_per_process_memory_fraction(0.001)\n"
             "try:\n    torch.empty(64 << 20, dtype=torch.uint8, device='neuron')\n"
             "except torch.OutOfMemoryError: print('oom')\n", TORCH_NEURONX_HBM_BYTES="16GiB")
    assert r.stdout.strip() == "oom", r.stderr


def test_host_memory_exhaustion_is_oom_not_kill():
    r = _run("import torch\n"
             "try:\n    torch.empty(1 << 44, dtype=torch.uint8, device='neuron')\n"
             "except torch.OutOfMemoryError as e: print('oom', 'host' in str(e))\n"
             "print(torch.ones(2, device='neuron').sum().item())",
             TORCH_NEURONX_HBM_BYTES="32TiB")
    assert r.stdout.split() == ["oom", "True", "2.0"], r.stderr


def test_training_does_not_leak():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(N)
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    x = torch.randn(16, 32, device=N)

    def step():
        opt.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        opt.step()
    for _ in range(3):
        step()
    base = torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    for _ in range(50):
        step()
    assert torch.neuron.memory_allocated() == base
    assert torch.neuron.memory_reserved() <= 1.25 * torch.neuron.max_memory_allocated() + (1 << 20)


def test_pinned_memory_and_dataloader():
    x = torch.randn(4).pin_memory()
    assert x.is_pinned()
    ds = torch.utils.data.TensorDataset(torch.randn(8, 2))
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4, pin_memory=True,
                                                  pin_memory_device=N)))[0]
    assert batch.is_pinned()
    assert batch.to(N, non_blocking=True).device.type == N


# ---------------------------------------------------------------- RNG

def test_rng_matches_cpu_sequence():
    torch.manual_seed(123)
    a = torch.randn(64, device=N)
    b = torch.rand(8, device=N)
    torch.manual_seed(123)
    assert torch.equal(a.cpu(), torch.randn(64)) and torch.equal(b.cpu(), torch.rand(8))


def test_rng_state_per_device():
    torch.neuron.manual_seed_all(5)
    s0 = torch.neuron.get_rng_state(0)
    x = torch.randn(4, device="neuron:0")
    torch.randn(4, device="neuron:1")
    torch.neuron.set_rng_state(s0, 0)
    assert torch.equal(torch.randn(4, device="neuron:0").cpu(), x.cpu())
    torch.neuron.manual_seed(7)
    assert torch.neuron.initial_seed() == 7
    assert len(torch.neuron.get_rng_state_all()) == 4


def test_generator_and_random_ops():
    g = torch.Generator(device=N).manual_seed(3)
    c = torch.Generator().manual_seed(3)
    assert torch.equal(torch.rand(5, device=N, generator=g).cpu(), torch.rand(5, generator=c))
    p = torch.ones(10, device=N)
    assert torch.multinomial(p, 4).device.type == N
    torch.manual_seed(1)
    d = torch.nn.functional.dropout(torch.ones(100, device=N), 0.5)
    torch.manual_seed(1)
    assert torch.equal(d.cpu(), torch.nn.functional.dropout(torch.ones(100), 0.5))


# ---------------------------------------------------------------- streams and events

def test_streams_and_events():
    s = torch.neuron.Stream()
    cur = torch.neuron.current_stream()
    assert cur.stream_id == 0 and s.stream_id != 0
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream().stream_id == s.stream_id
        y = torch.ones(3, device=N) * 2
    assert torch.neuron.current_stream() == cur
    cur.wait_stream(s)
    y.record_stream(cur)
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    torch.randn(64, 64, device=N) @ torch.randn(64, 64, device=N)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0 and end.query()
    assert isinstance(end, torch.neuron.Event)
    g = torch.Stream(N)  # no index: the current device's, as for CUDA
    assert g.device.type == N and g.device.index == torch.neuron.current_device() and g.query()
    torch.neuron.synchronize()
    torch.accelerator.synchronize()
    assert torch.neuron.Stream(priority=-1).query()
    # one priority level, as CUDA reports a clamped request
    assert torch.neuron.Stream(priority=-1).priority == 0
    assert torch.neuron.Stream.priority_range() == (0, 0)


# ---------------------------------------------------------------- integration

def test_autocast_bf16_default_and_policy():
    a, b = torch.randn(4, 4, device=N), torch.randn(4, 4, device=N)
    with torch.autocast(device_type=N):
        assert (a @ b).dtype == torch.bfloat16
        assert torch.nn.functional.linear(a, b).dtype == torch.bfloat16
        assert torch.softmax(a, -1).dtype == torch.float32
        assert (a @ b).float().sum().dtype == torch.float32
    with torch.autocast(device_type=N, dtype=torch.float16):
        assert (a @ b).dtype == torch.float16
    with torch.autocast(device_type="cpu"):
        assert (a @ b).dtype == torch.float32


def test_grad_scaler():
    m = torch.nn.Linear(4, 1).to(N)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(N)
    loss = m(torch.randn(3, 4, device=N)).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 65536.0
    m.weight.grad.fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 32768.0


def test_save_load_both_ways(tmp_path):
    x = torch.randn(3, 3)
    d = x.to("neuron:1")
    path = tmp_path / "t.pt"
    torch.save({"d": d, "c": x}, path)
    back = torch.load(path)
    assert back["d"].device == torch.device("neuron:1") and torch.equal(back["d"].cpu(), x)
    assert torch.load(path, map_location="cpu")["d"].device.type == "cpu"
    torch.save(x, path)
    assert torch.load(path, map_location="neuron:2").device == torch.device("neuron:2")
    m = torch.nn.Linear(3, 2).to(N)
    torch.save(m.state_dict(), path)
    m2 = torch.nn.Linear(3, 2)
    m2.load_state_dict(torch.load(path, map_location="cpu"))
    assert torch.equal(m2.weight, m.weight.cpu())


def test_corrupt_and_foreign_files_are_clear(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(Exception, match="(?i)invalid|pickle|zip|load"):
        torch.load(bad)
    x = torch.randn(2)
    with pytest.raises(RuntimeError, match="(?i)device|neuron|invalid"):
        buf = io.BytesIO()
        torch.save(x, buf)
        buf.seek(0)
        torch.load(buf, map_location="neuron:11")
    assert torch.ones(1, device=N).item() == 1


def test_module_helpers():
    m = torch.nn.Linear(2, 2)
    assert next(m.neuron().parameters()).device.type == N
    assert next(torch.nn.Linear(2, 2).to(N).parameters()).is_neuron
    assert torch.ones(1).neuron().is_neuron


@pytest.mark.parametrize("opt_cls,kw", [
    (torch.optim.AdamW, {"foreach": True}), (torch.optim.AdamW, {"fused": True}),
    (torch.optim.SGD, {"foreach": True, "momentum": 0.9}), (torch.optim.SGD, {"fused": True}),
    (torch.optim.Adam, {"foreach": False}),
])
def test_optimizers_match_cpu(opt_cls, kw):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    md = __import__("copy").deepcopy(m).to(N)
    oc, od = opt_cls(m.parameters(), lr=0.01, **kw), opt_cls(md.parameters(), lr=0.01, **kw)
    x = torch.randn(5, 8)
    for _ in range(3):
        for mod, opt, inp in ((m, oc, x), (md, od, x.to(N))):
            opt.zero_grad()
            mod(inp).square().sum().backward()
            opt.step()
    for p, q in zip(m.parameters(), md.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=0, atol=0)


def test_small_transformer_trains_like_cpu():
    from torch_neuronx.demo.gpt import GPT, GPTConfig
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)
    torch.manual_seed(0)
    m = GPT(cfg)
    md = __import__("copy").deepcopy(m).to(N)
    x = torch.randint(0, 256, (4, 16))
    y = torch.randint(0, 256, (4, 16))
    losses = []
    for mod, inp, tgt in ((m, x, y), (md, x.to(N), y.to(N))):
        opt = torch.optim.AdamW(mod.parameters(), lr=1e-2, foreach=True)
        ls = []
        for _ in range(5):
            opt.zero_grad()
            _, loss = mod(inp, tgt)
            loss.backward()
            opt.step()
            ls.append(loss.item())
        losses.append(ls)
    assert losses[0] == losses[1]
    assert losses[1][-1] < losses[1][0]


# ---------------------------------------------------------------- modelled time

def test_modelled_time_roofline():
    torch_neuronx.reset_modelled_time()
    a = torch.randn(1024, 1024, device=N, dtype=torch.bfloat16)
    torch_neuronx.reset_modelled_time()
    a @ a
    t = torch_neuronx.modelled_time(reset=True)
    p = torch_neuronx._state.config().profile
    # Every kernel: one launch (2 us) and the DMA-in / engine / DMA-out latency (2 x 0.6 us
    # DMA + 2 x 1.3 us semaphores); trn2's numbers, from its profile.
    fixed = (p.launch_overhead_ns + 2 * p.dma_fixed_ns + 2 * p.semaphore_ns) * 1e-9
    assert fixed == pytest.approx(5.8e-6)
    # 2 GFLOP at 158 TFLOPS (two physical cores): ~13.6 us
    assert t.launches == 1 and 12e-6 < t.seconds - fixed < 20e-6, t
    assert t.by_engine["tensor"] > 0
    b = a.float()
    torch_neuronx.reset_modelled_time()
    b @ b
    t32 = torch_neuronx.modelled_time(reset=True)
    # fp32 is 4x slower on TensorE
    assert 3.5 < (t32.seconds - fixed) / (t.seconds - fixed) < 4.5
    x = torch.randn(1 << 22, device=N)
    torch_neuronx.reset_modelled_time()
    x + x
    t_add = torch_neuronx.modelled_time(reset=True)
    # 48 MiB over 725 GB/s: HBM bound
    assert t_add.seconds == pytest.approx(fixed + 3 * 4 * (1 << 22) / 725e9, rel=0.05)


def test_modelled_time_follows_platform():
    r = _run("import torch, torch_neuronx\n"
             "a = torch.randn(512, 512, device='neuron', dtype=torch.bfloat16)\n"
             "torch_neuronx.reset_modelled_time(); a @ a\n"
             "print(torch_neuronx.modelled_time().platform)", NEURON_PLATFORM_TARGET_OVERRIDE="trn3")
    assert r.stdout.strip() == "trn3", r.stderr


# ---------------------------------------------------------------- sparse

def test_sparse_coo_matches_cpu():
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    x[x < 0.3] = 0
    s = x.to_sparse()
    sn = s.to(N)
    assert sn.device.type == N and sn.layout == torch.sparse_coo and sn._values().is_neuron
    dense = torch.randn(5, 3)
    torch.testing.assert_close(torch.sparse.mm(sn, dense.to(N)).cpu(), torch.sparse.mm(s, dense),
                               rtol=0, atol=0)
    torch.testing.assert_close((sn + sn).coalesce().to_dense().cpu(), (s + s).to_dense(),
                               rtol=0, atol=0)
    m = sn.clone().mul_(3)
    assert torch.equal(m.to_dense().cpu(), x * 3)
    assert x.to(N).to_sparse().device.type == N
    assert torch.equal(sn.cpu().to_dense(), x)
    w, wc = x.to(N).requires_grad_(), x.clone().requires_grad_()
    torch.sparse.sum(w.to_sparse() * 2).backward()
    torch.sparse.sum(wc.to_sparse() * 2).backward()
    assert torch.equal(w.grad.cpu(), wc.grad)


def test_sparse_csr_matches_cpu():
    x = torch.randn(4, 6)
    x[x < 0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = x.to_sparse_csr()
        cn = c.to(N)
        assert cn.layout == torch.sparse_csr and cn.crow_indices().is_neuron
        v = torch.randn(6, 2)
        torch.testing.assert_close((cn @ v.to(N)).cpu(), c @ v, rtol=0, atol=0)
        assert torch.equal(x.to(N).to_sparse_csr().to_dense().cpu(), x)
