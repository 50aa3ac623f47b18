"""Paths a CUDA-tested program takes on a non-CPU device, held to CUDA's documented rules:
event completion, torch.accelerator, autocast's op lists, backend tensor metadata."""
import io
import os
import random
import re

import pytest
import torch
import torch.nn.functional as F

DEV = "neuron"


# --- Events: complete once any synchronisation has shown their work done ---------------------
def _program(rng, n_streams, steps):
    return [(rng.choice(["work", "record", "wait", "sync_stream", "sync_event", "sync_device",
                         "query"]), rng.randrange(n_streams), rng.randrange(4)) for _ in range(steps)]


@pytest.mark.parametrize("seed", range(12))
def test_event_queries_follow_cuda_rules_over_random_programs(seed):
    """A vector-clock model of CUDA's rules: each stream's tail covers some prefix of every
    stream's work; an event covers what its stream's tail covered when recorded; a wait
    merges the event into the stream's tail; a synchronisation (stream, event, device, or a
    query answering True) makes what it covers known done. Whatever the model knows done,
    ``query`` must report done."""
    rng = random.Random(seed)
    streams = [torch.neuron.current_stream()] + [torch.neuron.Stream() for _ in range(2)]
    n = len(streams)
    tail = [[0] * n for _ in range(n)]
    done = [0] * n
    events, covers = {}, {}
    x = torch.randn(192, 192, device=DEV)
    for op, s, k in _program(rng, n, 40):
        if op == "work":
            with torch.neuron.stream(streams[s]):
                x = torch.tanh(x @ x * 1e-3)
            tail[s][s] += 1
        elif op == "record":  # the record is itself an item of the stream's queue
            events[k] = torch.neuron.Event()
            events[k].record(streams[s])
            tail[s][s] += 1
            covers[k] = list(tail[s])
        elif op == "wait" and k in events:
            streams[s].wait_event(events[k])
            tail[s] = [max(a, b) for a, b in zip(tail[s], covers[k])]
        elif op == "sync_stream":
            streams[s].synchronize()
            done = [max(a, b) for a, b in zip(done, tail[s])]
        elif op == "sync_event" and k in events:
            events[k].synchronize()
            done = [max(a, b) for a, b in zip(done, covers[k])]
        elif op == "sync_device":
            torch.neuron.synchronize()
            for t in tail:
                done = [max(a, b) for a, b in zip(done, t)]
        elif op == "query" and k in events:
            known = all(c <= d for c, d in zip(covers[k], done))
            answer = events[k].query()
            if known:
                assert answer, (op, s, k, covers[k], done)
            if answer:
                done = [max(a, b) for a, b in zip(done, covers[k])]
    torch.neuron.synchronize()
    assert all(e.query() for e in events.values())


def test_wait_then_synchronize_the_waiting_stream_completes_the_event():
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    with torch.neuron.stream(s1):
        x = torch.randn(512, 512, device=DEV)
        for _ in range(4):
            x = x @ x * 1e-3
    e = torch.neuron.Event()
    e.record(s1)
    s2.wait_event(e)
    s2.synchronize()
    assert e.query()


# --- torch.accelerator: every public function answers for neuron --------------------------
def _call(name):
    import torch.accelerator as A
    f = getattr(A, name)
    if name == "device_index":
        with f(0):
            return A.current_device_index()
    if name in ("set_device_idx", "set_device_index"):
        return f(0)
    if name == "set_stream":
        return f(A.current_stream())
    return f()


@pytest.mark.parametrize("name", sorted(torch.accelerator.__all__))
def test_accelerator_function_answers_for_neuron(name):
    if name == "Graph":  # a class: capture and replay are tests/device/test_graphs.py's
        x = torch.zeros(2, device=DEV)
        g = torch.accelerator.Graph()
        with g:
            x.add_(1)
        g.replay()
        assert torch.equal(x.cpu(), torch.ones(2))
        return
    _call(name)
    assert torch.accelerator.current_accelerator().type == DEV


def test_empty_host_cache_after_pinned_copies():
    # The device's host allocator is the pinned one; torch calls it as an at::HostAllocator.
    x = torch.randn(256, 256).pin_memory()
    y = x.to(DEV, non_blocking=True)
    torch.neuron.synchronize()
    del x
    torch.accelerator.empty_host_cache()
    assert y.sum().item() == y.cpu().sum().item()


def test_accelerator_answers_match_torch_neuron():
    assert torch.accelerator.device_count() == torch.neuron.device_count()
    assert torch.accelerator.memory_allocated() == torch.neuron.memory_allocated()
    cap = torch.accelerator.get_device_capability()
    assert {torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn} <= cap["supported_dtypes"]
    assert torch.qint8 not in cap["supported_dtypes"]  # eager quantized tensors have no neuron storage
    free, total = torch.accelerator.get_memory_info()
    assert 0 <= free <= total


# --- Autocast: CUDA's op lists, both low-precision dtypes ---------------------------------
def _autocast_lists():
    path = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")
    text = open(path).read()
    lists = {}
    for macro, policy in [("AT_FORALL_LOWER_PRECISION_FP", "low"), ("AT_FORALL_FP32", "fp32"),
                          ("AT_FORALL_FP32_SET_OPT_DTYPE", "fp32"),
                          ("AT_FORALL_PROMOTE", "promote")]:
        body = re.search(r"#define %s\(_\)(.*?)\n\n" % macro, text, re.S).group(1)
        for name in re.findall(r"_\((\w+)", body):
            lists.setdefault(name, policy)
    return lists


_LISTS = _autocast_lists()


def _cases():
    # Every listed op whose functional torch name has an OpInfo with floating samples.
    from torch.testing._internal.common_methods_invocations import op_db
    by_aten = {}
    for op in op_db:
        if op.variant_test_name == "" and op.aten_name not in by_aten:
            by_aten[op.aten_name] = op
    for name, policy in sorted(_LISTS.items()):
        if name in by_aten:
            for dtype in (torch.float16, torch.bfloat16):
                yield pytest.param(by_aten[name], policy, dtype, id=f"{name}-{policy}-{str(dtype)[6:]}")


def test_autocast_lists_were_read():
    assert _LISTS["mm"] == "low" and _LISTS["dot"] == "promote" and _LISTS["softmax"] == "fp32"
    assert len(list(_cases())) >= 40


@pytest.mark.parametrize("op,policy,dtype", list(_cases()))
def test_autocast_accepts_cuda_listed_op_with_low_precision_inputs(op, policy, dtype):
    """With inputs of either low-precision dtype, under either autocast dtype, each listed op
    runs and its floating result has the policy's dtype: the autocast dtype (lower-precision
    list), float32 (fp32 list), or the inputs' own widest type (promote list)."""
    samples = [s for s in op.sample_inputs("cpu", dtype, requires_grad=False)][:2]
    if not samples:
        pytest.skip(f"{op.name}: no autocast samples in OpInfo")
    for autocast_dtype in (torch.float16, torch.bfloat16):
        for s in samples:
            def dev(t):
                return t.to(DEV) if isinstance(t, torch.Tensor) else (
                    [dev(v) for v in t] if isinstance(t, list) else t)
            args = [dev(s.input)] + [dev(a) for a in s.args]
            kwargs = {k: dev(v) for k, v in s.kwargs.items()}
            with torch.autocast(DEV, dtype=autocast_dtype):
                out = op(*args, **kwargs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            floats = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
            want = {"low": autocast_dtype, "fp32": torch.float32, "promote": dtype}[policy]
            if policy == "fp32" and "dtype" in kwargs and kwargs["dtype"] is not None:
                want = kwargs["dtype"]
            for o in floats[:1]:
                assert o.dtype == want, (op.name, policy, autocast_dtype, o.dtype)


def test_promote_ops_mixing_half_and_bfloat16_run_in_float32():
    a = torch.randn(8, device=DEV, dtype=torch.float16)
    b = torch.randn(8, device=DEV, dtype=torch.bfloat16)
    with torch.autocast(DEV):  # bfloat16 by default
        assert torch.dot(a, a).dtype == torch.float16  # CUDA fails here with "prioritize"
        assert torch.dot(b, b).dtype == torch.bfloat16
        r = torch.dot(a, b)
    assert r.dtype == torch.float32
    torch.testing.assert_close(r.cpu(), torch.dot(a.cpu().float(), b.cpu().float()))
    with torch.autocast(DEV, dtype=torch.float16):
        assert torch.addcmul(a, a, a.float()).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_binary_cross_entropy_is_banned_under_autocast_as_on_cuda(dtype):
    x, t = torch.randn(4, 3, device=DEV), torch.rand(4, 3, device=DEV)
    lin = torch.nn.Linear(3, 3).to(DEV)
    with torch.autocast(DEV, dtype=dtype):
        with pytest.raises(RuntimeError, match="unsafe to autocast.*with_logits"):
            torch.nn.functional.binary_cross_entropy(torch.sigmoid(lin(x)), t)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(lin(x), t)
    assert loss.dtype == torch.float32
    assert torch.nn.functional.binary_cross_entropy(torch.sigmoid(x), t).dtype == torch.float32


# --- Backend tensor metadata ----------------------------------------------------------------
def test_tensor_metadata_is_kept_and_survives_save_load_and_detach():
    x = torch.randn(4, device=DEV)
    assert torch._utils.get_tensor_metadata(x) == {}
    torch._utils.set_tensor_metadata(x, {"packed": True, "sharded": False})
    assert torch._utils.get_tensor_metadata(x) == {"packed": True, "sharded": False}
    assert torch._utils.get_tensor_metadata(x.detach()) == {"packed": True, "sharded": False}
    buf = io.BytesIO()
    torch.save({"w": x}, buf)
    buf.seek(0)
    y = torch.load(buf)["w"]
    assert y.device == x.device and torch.equal(y.cpu(), x.cpu())
    assert torch._utils.get_tensor_metadata(y) == {"packed": True, "sharded": False}
    torch._utils.set_tensor_metadata(y, {"packed": False})
    assert torch._utils.get_tensor_metadata(x)["packed"] is True  # each tensor its own map


# --- Warnings: neuron warns where CPU warns, not more ---------------------------------------
def test_first_call_of_a_loss_warns_no_more_than_cpu():
    import warnings
    x, y = torch.randn(3, 5, 7, 2), torch.randn(3, 5, 7, 2)
    for dev in ("cpu", DEV):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = x.to(dev).requires_grad_()
            F.mse_loss(a, y.to(dev)).backward()   # a signature seen for the first time
        msgs = [str(w.message) for w in caught if "resized" in str(w.message)]
        assert msgs == [], (dev, msgs)
