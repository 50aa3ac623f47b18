"""torch.accelerator.Graph on neuron, checked against the same work run eagerly on CPU: capture
records the work without running it, replay runs it on the static tensors as they are at
replay time, and what CUDA forbids during capture (host synchronisation, reading device data
on the host) raises with the device still usable afterwards."""
import pytest
import torch

import torch_neuronx

DEV = "neuron"


def test_replay_reads_static_inputs_as_they_are_at_replay():
    x = torch.zeros(4, 8, device=DEV)
    w = torch.randn(8, 8)
    wd = w.to(DEV)
    g = torch.accelerator.Graph()
    with g:
        y = torch.relu(x @ wd) * 2 + 1
    for _ in range(3):
        new = torch.randn(4, 8)
        x.copy_(new)
        g.replay()
        torch.testing.assert_close(y.cpu(), torch.relu(new @ w) * 2 + 1, rtol=0, atol=0)


def test_capture_does_not_run_the_work():
    x = torch.ones(16, device=DEV)
    g = torch.accelerator.Graph()
    with g:
        x.mul_(3)
    assert torch.equal(x.cpu(), torch.ones(16))  # recorded, not run
    g.replay()
    g.replay()
    assert torch.equal(x.cpu(), torch.full((16,), 9.0))


def test_documented_form_side_stream_and_in_place():
    # torch.accelerator.Graph's own example: `with stream, graph: x += 1`
    x = torch.zeros(2000, device=DEV)
    stream = torch.Stream(device=DEV)
    graph = torch.accelerator.Graph()
    with stream, graph:
        x += 1
    graph.replay()
    graph.replay()
    torch.accelerator.synchronize()
    assert torch.equal(x.cpu(), torch.full((2000,), 2.0))


def test_views_of_captured_outputs_follow_replay():
    x = torch.zeros(6, device=DEV)
    g = torch.accelerator.Graph()
    with g:
        y = (x + 1).view(2, 3)
        z = y[:, 1:].sum(dim=1)
    x.copy_(torch.arange(6.0))
    g.replay()
    ref = (torch.arange(6.0) + 1).view(2, 3)
    assert torch.equal(y.cpu(), ref)
    assert torch.equal(z.cpu(), ref[:, 1:].sum(dim=1))


def test_random_ops_draw_new_numbers_each_replay():
    out = torch.empty(64, device=DEV)
    g = torch.accelerator.Graph()
    with g:
        out.uniform_()
    g.replay()
    a = out.cpu().clone()
    g.replay()
    b = out.cpu()
    assert not torch.equal(a, b)
    assert 0 <= float(a.min()) and float(a.max()) < 1


def test_whole_training_step_captured_as_cuda_docs_show():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(DEV)
    model.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static_x = torch.zeros(4, 8, device=DEV)
    static_t = torch.zeros(4, 2, device=DEV)
    data = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(4)]

    def step(m, o, x, t):
        o.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(m(x), t)
        loss.backward()
        o.step()
        return loss

    # warm-up outside capture (as CUDA requires: gradients allocated, lazy state built)
    static_x.copy_(data[0][0]), static_t.copy_(data[0][1])
    step(model, opt, static_x, static_t)
    step(ref, opt_ref, *data[0])
    g = torch.accelerator.Graph()
    with g:
        static_loss = step(model, opt, static_x, static_t)
    for x, t in data[1:]:
        static_x.copy_(x), static_t.copy_(t)
        g.replay()
        loss = step(ref, opt_ref, x, t)
        torch.testing.assert_close(static_loss.cpu(), loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())


def test_capturable_adam_step():
    torch.manual_seed(1)
    p_ref = torch.randn(32, requires_grad=True)
    p = p_ref.detach().to(DEV).requires_grad_()
    opt_ref = torch.optim.Adam([p_ref], lr=0.01)
    opt = torch.optim.Adam([p], lr=0.01, capturable=True)
    grads = [torch.randn(32) for _ in range(4)]
    p.grad = grads[0].to(DEV)
    p_ref.grad = grads[0].clone()
    opt.step(), opt_ref.step()
    g = torch.accelerator.Graph()
    with g:
        opt.step()
    for gr in grads[1:]:
        p.grad.copy_(gr)
        p_ref.grad.copy_(gr)
        g.replay()
        opt_ref.step()
    torch.testing.assert_close(p.detach().cpu(), p_ref.detach())


def test_host_state_written_during_capture_is_flagged():
    # Adam without capturable=True counts its steps in a CPU tensor, which a replay would
    # leave frozen; CUDA's optimizers refuse this for cuda/xpu only, so the capture warns.
    p = torch.zeros(4, device=DEV, requires_grad=True)
    p.grad = torch.ones(4, device=DEV)
    opt = torch.optim.Adam([p])
    opt.step()
    g = torch.accelerator.Graph()
    with pytest.warns(UserWarning, match="capturable=True"):
        with g:
            opt.step()
    assert torch.equal((torch.ones(2, device=DEV) + 1).cpu(), torch.ones(2) + 1)


def test_pageable_host_copy_is_refused_and_pinned_is_replayed():
    x = torch.zeros(8, device=DEV)
    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="pageable host memory"):
        with g:
            x.copy_(torch.ones(8))
    pinned = torch.ones(8).pin_memory()
    g2 = torch.accelerator.Graph()
    with g2:
        x.copy_(pinned, non_blocking=True)
    pinned.fill_(5)
    g2.replay()
    assert torch.equal(x.cpu(), torch.full((8,), 5.0))


def test_stream_reports_capturing():
    s = torch.accelerator.current_stream()
    assert not s.is_capturing()
    g = torch.accelerator.Graph()
    g.capture_begin()
    try:
        assert torch.accelerator.current_stream().is_capturing()
    finally:
        g.capture_end()
    assert not s.is_capturing()


@pytest.mark.parametrize("what", ["item", "cpu", "nonzero", "device_sync", "stream_sync", "event_sync"])
def test_host_reads_during_capture_raise_and_device_stays_usable(what):
    x = torch.arange(4.0, device=DEV)
    ev = torch.Event(device=torch.device(DEV))
    ev.record()
    actions = {"item": lambda: x.sum().item(), "cpu": lambda: x.cpu(), "nonzero": lambda: x.nonzero(),
               "device_sync": torch.accelerator.synchronize,
               "stream_sync": lambda: torch.accelerator.current_stream().synchronize(),
               "event_sync": ev.synchronize}
    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        with g:
            actions[what]()
    assert not torch.accelerator.current_stream().is_capturing()
    torch.accelerator.synchronize()
    assert torch.equal((torch.arange(3, device=DEV) * 2).cpu(), torch.arange(3) * 2)
    g2 = torch.accelerator.Graph()  # a failed capture leaves the device able to capture again
    with g2:
        x.add_(1)
    g2.replay()
    assert torch.equal(x.cpu(), torch.arange(4.0) + 1)


def test_keep_graph_instantiate_reset_pool_and_debug_dump(tmp_path):
    x = torch.zeros(3, device=DEV)
    g = torch.accelerator.Graph(keep_graph=True)
    g.enable_debug_mode()
    with g:
        x.add_(2)
    g.instantiate()
    g.replay()
    assert torch.equal(x.cpu(), torch.full((3,), 2.0))
    pool = g.pool()
    assert isinstance(pool, tuple) and len(pool) == 2
    path = tmp_path / "graph.dot"
    g.debug_dump(str(path))
    assert "add_" in path.read_text()
    g.reset()
    with pytest.raises(RuntimeError, match="replay"):
        g.replay()
    with g:
        x.mul_(10)
    g.replay()
    assert torch.equal(x.cpu(), torch.full((3,), 20.0))
    g2 = torch.accelerator.Graph(pool=pool)  # sharing a pool, as CUDA allows
    with g2:
        x.sub_(1)
    g2.replay()
    assert torch.equal(x.cpu(), torch.full((3,), 19.0))


def test_capture_end_without_begin_is_a_clear_error():
    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="capture_end"):
        g.capture_end()


def test_cuda_style_names_graph_context_and_pool_handle():
    # torch.cuda's spelling: torch.cuda.CUDAGraph / torch.cuda.graph / graph_pool_handle
    x = torch.zeros(5, device=DEV)
    assert not torch.neuron.is_current_stream_capturing()
    g = torch.neuron.NeuronGraph()
    pool = torch.neuron.graph_pool_handle()
    with torch.neuron.graph(g, pool=pool):
        assert torch.neuron.is_current_stream_capturing()
        assert torch.accelerator.current_stream() != torch.neuron.default_stream()  # side stream
        y = x * 3
    assert not torch.neuron.is_current_stream_capturing()
    x.fill_(2)
    g.replay()
    assert torch.equal(y.cpu(), torch.full((5,), 6.0))
    assert g.pool() == pool
    g2 = torch.neuron.NeuronGraph()
    g2.capture_begin(pool=pool)
    x.add_(1)
    g2.capture_end()
    g2.replay()
    assert torch.equal(x.cpu(), torch.full((5,), 3.0))
    with pytest.raises(ValueError, match="capture_error_mode"):
        torch.neuron.graph(g2, capture_error_mode="loose")


def test_gpt_training_step_replay_equals_eager_bit_for_bit():
    from torch_neuronx.demo.gpt import GPT, GPTConfig
    cfg = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    eager = GPT(cfg).to(DEV)
    graphed = GPT(cfg).to(DEV)
    graphed.load_state_dict(eager.state_dict())
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True) for m in (eager, graphed)}
    batches = [torch.randint(0, cfg.vocab_size, (2, cfg.block_size)) for _ in range(5)]
    static_x = torch.zeros(2, cfg.block_size, dtype=torch.long, device=DEV)

    def step(m, x):
        opts[m].zero_grad(set_to_none=False)
        _, loss = m(x, x)
        loss.backward()
        opts[m].step()
        return loss

    static_x.copy_(batches[0].to(DEV))
    step(graphed, static_x)  # warm-up: gradients and optimizer state exist before capture
    step(eager, batches[0].to(DEV))
    g = torch.neuron.NeuronGraph()
    with torch.neuron.graph(g):
        static_loss = step(graphed, static_x)
    for b in batches[1:]:
        static_x.copy_(b.to(DEV))
        g.replay()
        loss = step(eager, b.to(DEV))
        assert torch.equal(static_loss.cpu(), loss.detach().cpu())
    for p, q in zip(graphed.parameters(), eager.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())


def test_nki_kernels_captured_through_nki_op_and_refused_when_called_directly():
    import nki
    import nki.language as nl
    from torch_neuronx import nki_op

    @nki.jit
    def mul_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.multiply(nl.load(a), nl.load(b)))
        return out

    op = nki_op("graph_test::mul", mul_kernel, mutates_args=())
    a, b = torch.zeros(8, 4, device=DEV), torch.full((8, 4), 2.0, device=DEV)
    g = torch.accelerator.Graph()
    with g:
        c = op(a, b)
    a.fill_(3.0)
    g.replay()
    assert torch.equal(c.cpu(), torch.full((8, 4), 6.0))
    with pytest.raises(RuntimeError, match="register the kernel with torch_neuronx.nki_op"):
        with torch.accelerator.Graph():
            mul_kernel(a, b)
    assert torch.equal(mul_kernel(a, b).cpu(), torch.full((8, 4), 6.0))  # eager still works


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def test_make_graphed_callables_module_trains_as_eager():
    torch.manual_seed(3)
    ref = _mlp()
    graphed = _mlp().to(DEV)
    graphed.load_state_dict(ref.state_dict())
    sample = torch.randn(6, 8, device=DEV)
    graphed = torch.neuron.make_graphed_callables(graphed, (sample,))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(graphed.parameters(), lr=0.1)
    for _ in range(4):
        x, t = torch.randn(6, 8), torch.randn(6, 4)
        for m, o, xx, tt in ((ref, opt_ref, x, t), (graphed, opt, x.to(DEV), t.to(DEV))):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xx), tt).backward()
            o.step()
    for p, q in zip(graphed.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())
    graphed.eval()  # eval mode runs the module eagerly, as CUDA's does
    x = torch.randn(3, 8)  # another batch size works outside the graph
    torch.testing.assert_close(graphed(x.to(DEV)).detach().cpu(), ref(x).detach())


def test_make_graphed_callables_functions_and_input_grads():
    def f(a, b):
        return (a * b).sin(), a.exp()

    def g(c):
        return c.tanh() * 2

    a = torch.randn(5, device=DEV, requires_grad=True)
    b = torch.randn(5, device=DEV)
    c = torch.randn(5, device=DEV, requires_grad=True)
    gf, gg = torch.neuron.make_graphed_callables((f, g), ((a, b), (c,)))
    for _ in range(2):
        x, y = torch.randn(5), torch.randn(5)
        xd = x.to(DEV).requires_grad_()
        s, e = gf(xd, y.to(DEV))
        (s.sum() + gg(e).sum()).backward()
        xr = x.clone().requires_grad_()
        sr, er = f(xr, y)
        (sr.sum() + g(er).sum()).backward()
        torch.testing.assert_close(s.detach().cpu(), sr.detach())
        torch.testing.assert_close(xd.grad.cpu(), xr.grad)
    with pytest.raises(TypeError, match="only Tensors"):
        torch.neuron.make_graphed_callables(g, (1.0,))


def test_autocast_step_captured_equals_eager():
    torch.manual_seed(4)
    eager, graphed = _mlp().to(DEV), _mlp().to(DEV)
    graphed.load_state_dict(eager.state_dict())
    static_x = torch.zeros(6, 8, device=DEV)

    def fwd(m, x):
        with torch.autocast("neuron", dtype=torch.bfloat16):
            return m(x).float().square().mean()

    fwd(graphed, static_x)
    g = torch.accelerator.Graph()
    with g:
        static_loss = fwd(graphed, static_x)
    for _ in range(3):
        x = torch.randn(6, 8, device=DEV)
        static_x.copy_(x)
        g.replay()
        assert torch.equal(static_loss.cpu(), fwd(eager, x).detach().cpu())
