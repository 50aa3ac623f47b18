"""Rank programs of the distributed tests (run by _launch.run, one process per rank).

Each scenario checks its results against a single-process CPU computation made in the same
process without torch.distributed, and exits non-zero (with a traceback) on a mismatch.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import warnings

import torch
import torch.distributed as dist

# PyTorch 2.13 renamed several collectives; the tests keep the widely used names.
warnings.filterwarnings("ignore", category=FutureWarning)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models as M  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
DEV = torch.device("neuron", int(os.environ.get("LOCAL_RANK", "0")))


def close(a, b, atol=1e-5, rtol=1e-5, what=""):
    a = a.detach().to("cpu") if isinstance(a, torch.Tensor) else torch.tensor(a)
    b = b.detach().to("cpu") if isinstance(b, torch.Tensor) else torch.tensor(b)
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    if not torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol):
        raise AssertionError(f"{what}: max diff {(a.float() - b.float()).abs().max().item()}\n{a}\n{b}")


def init(timeout: float = 60.0):
    dist.init_process_group("neuron", timeout=timedelta(seconds=timeout))
    assert torch.neuron.current_device() == DEV.index, "LOCAL_RANK did not select the device"
    assert dist.get_backend() == "neuron"


def rank_tensor(r, shape=(3, 4), dtype=torch.float32):
    g = torch.Generator().manual_seed(17 + r)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


# --- collectives ----------------------------------------------------------------------------
def _collectives_on(device: torch.device):
    p, r = WORLD, RANK
    ins = [rank_tensor(i) for i in range(p)]       # what every rank holds, computed locally
    mine = ins[r].to(device).clone()

    # all_reduce, every ReduceOp
    refs = {dist.ReduceOp.SUM: sum(ins), dist.ReduceOp.AVG: sum(ins) / p,
            dist.ReduceOp.MAX: torch.stack(ins).amax(0), dist.ReduceOp.MIN: torch.stack(ins).amin(0),
            dist.ReduceOp.PRODUCT: torch.stack(ins).prod(0)}
    for op, ref in refs.items():
        t = mine.clone()
        dist.all_reduce(t, op=op)
        close(t, ref, what=f"all_reduce {op} on {device}")
        assert t.device == mine.device
    t = mine.clone()
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    close(t, sum(ins) * 0.5, what="all_reduce PREMUL_SUM")
    ints = [torch.tensor([5 + i, 12 ^ i, 3 * i + 1], dtype=torch.int64) for i in range(p)]
    for op, fn in ((dist.ReduceOp.BAND, lambda a, b: a & b), (dist.ReduceOp.BOR, lambda a, b: a | b),
                   (dist.ReduceOp.BXOR, lambda a, b: a ^ b)):
        ref = ints[0]
        for x in ints[1:]:
            ref = fn(ref, x)
        t = ints[r].to(device).clone()
        dist.all_reduce(t, op=op)
        close(t, ref, what=f"all_reduce {op}")
    for dtype, tol in ((torch.bfloat16, 5e-2), (torch.float16, 1e-2), (torch.float64, 1e-12), (torch.int32, 0)):
        t = ins[r].to(dtype).to(device)
        dist.all_reduce(t)
        close(t, sum(x.to(dtype) for x in ins), atol=tol, rtol=tol, what=f"all_reduce {dtype}")
    # non-contiguous in-place all_reduce writes through to the view's base
    base = torch.zeros(4, 6, device=device)
    view = base[:, ::2]
    view.copy_(ins[r][:, :3].reshape(4, 3) if False else torch.arange(12.).reshape(4, 3) * (r + 1))
    dist.all_reduce(view)
    close(base[:, ::2], torch.arange(12.).reshape(4, 3) * sum(range(1, p + 1)), what="non-contiguous")
    close(base[:, 1::2], torch.zeros(4, 3), what="non-contiguous untouched")

    # async handles and futures resolve to the caller's tensors
    t = mine.clone()
    work = dist.all_reduce(t, async_op=True)
    fut_val = work.get_future().wait()
    assert fut_val[0].device == device and fut_val[0].data_ptr() == t.data_ptr()
    assert work.wait() and work.is_completed()
    close(t, sum(ins), what="async all_reduce")

    # broadcast / reduce from each root
    for root in range(p):
        t = mine.clone()
        dist.broadcast(t, src=root)
        close(t, ins[root], what=f"broadcast src={root}")
        t = mine.clone()
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
        if r == root:
            close(t, sum(ins), what=f"reduce dst={root}")
    f8 = ins[r].to(torch.float8_e4m3fn).to(device)
    dist.broadcast(f8, src=0)
    close(f8.to("cpu").float(), ins[0].to(torch.float8_e4m3fn).float(), what="broadcast float8")

    # all_gather: list and into-tensor
    outs = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(outs, mine)
    for i in range(p):
        close(outs[i], ins[i], what="all_gather")
    out = torch.empty(p * 3, 4, device=device)
    dist.all_gather_into_tensor(out, mine)
    close(out, torch.cat(ins), what="all_gather_into_tensor")

    # reduce_scatter: list and tensor
    chunks = [rank_tensor(100 * i + j, (2, 4)) for i in range(p) for j in range(p)]  # rank i's j-th
    out = torch.empty(2, 4, device=device)
    dist.reduce_scatter(out, [chunks[r * p + j].to(device) for j in range(p)])
    close(out, sum(chunks[i * p + r] for i in range(p)), what="reduce_scatter list")
    inp = torch.cat([chunks[r * p + j] for j in range(p)]).to(device)
    out = torch.empty(2, 4, device=device)
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG)
    close(out, sum(chunks[i * p + r] for i in range(p)) / p, what="reduce_scatter_tensor AVG")

    # all_to_all_single with uneven splits: rank i sends (i + j + 1) rows to rank j
    def rows(i, j):
        return i + j + 1
    src = [torch.arange(sum(rows(i, j) for j in range(p)) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * i
           for i in range(p)]
    out = torch.empty(sum(rows(i, r) for i in range(p)), 2, device=device)
    dist.all_to_all_single(out, src[r].to(device), output_split_sizes=[rows(i, r) for i in range(p)],
                           input_split_sizes=[rows(r, j) for j in range(p)])
    expect = torch.cat([src[i].split([rows(i, j) for j in range(p)])[r] for i in range(p)])
    close(out, expect, what="all_to_all_single uneven")
    even = torch.arange(p * 2.).reshape(p, 2) + 10 * r
    out = torch.empty(p, 2, device=device)
    dist.all_to_all_single(out, even.to(device))
    close(out, torch.stack([torch.arange(p * 2.).reshape(p, 2)[r] + 10 * i for i in range(p)]), what="all_to_all_single")
    # all_to_all lists, uneven sizes
    in_list = [torch.full((j + 1,), float(10 * r + j), device=device) for j in range(p)]
    out_list = [torch.empty(r + 1, device=device) for _ in range(p)]
    dist.all_to_all(out_list, in_list)
    for i in range(p):
        close(out_list[i], torch.full((r + 1,), float(10 * i + r)), what="all_to_all")

    # gather / scatter
    for root in range(p):
        gl = [torch.empty_like(mine) for _ in range(p)] if r == root else None
        dist.gather(mine, gl, dst=root)
        if r == root:
            for i in range(p):
                close(gl[i], ins[i], what="gather")
        out = torch.empty(3, 4, device=device)
        dist.scatter(out, [x.to(device) for x in ins] if r == root else None, src=root)
        close(out, ins[r], what="scatter")

    # point to point: a ring, blocking, non-blocking and batched
    nxt, prv = (r + 1) % p, (r - 1) % p
    if r % 2 == 0:
        dist.send(mine, dst=nxt)
        t = torch.empty_like(mine)
        dist.recv(t, src=prv)
    else:
        t = torch.empty_like(mine)
        dist.recv(t, src=prv)
        dist.send(mine, dst=nxt)
    close(t, ins[prv], what="send/recv")
    t = torch.empty_like(mine)
    reqs = [dist.isend(mine, dst=nxt), dist.irecv(t, src=prv)]
    for q in reqs:
        q.wait()
    close(t, ins[prv], what="isend/irecv")
    t = torch.empty_like(mine)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt), dist.P2POp(dist.irecv, t, prv)])
    for q in reqs:
        q.wait()
    close(t, ins[prv], what="batch_isend_irecv")
    if r == 0:
        t = torch.empty_like(mine)
        src_rank = dist.recv(t)  # any source
        close(t, ins[src_rank], what="recv any source")
    elif r == 1:
        dist.send(mine, dst=0)

    # coalesced variants
    ts = [mine.clone(), (mine * 2)[:2]]
    dist.all_reduce_coalesced(ts)
    close(ts[0], sum(ins), what="all_reduce_coalesced")
    close(ts[1], 2 * sum(ins)[:2], what="all_reduce_coalesced second")
    outs = [[torch.empty_like(mine) for _ in range(p)]]
    dist.all_gather_coalesced(outs, [mine])
    close(torch.cat(outs[0]), torch.cat(ins), what="all_gather_coalesced")
    a, b = mine.clone(), (mine + 1).clone()
    with dist._coalescing_manager(device=device):
        dist.all_reduce(a)
        dist.all_reduce(b)
    close(a, sum(ins), what="coalescing manager a")
    close(b, sum(ins) + p, what="coalescing manager b")

    dist.barrier()
    w = dist.barrier(async_op=True)
    w.wait()


def scenario_collectives():
    init()
    import torch_neuronx
    torch_neuronx.reset_modelled_time(DEV)
    for device in (DEV, torch.device("cpu")):
        _collectives_on(device)
    mt = torch_neuronx.modelled_time(DEV)
    assert mt.by_engine.get("collective", 0) > 0, "no modelled collective time"
    assert any(k.startswith("c10d::all_reduce") for k in mt.by_op), mt.by_op.keys()

    # object collectives go through the cpu side of the same group
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": RANK})
    assert objs == [{"rank": i} for i in range(WORLD)], objs
    lst = [RANK * 7] if RANK == 0 else [None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [0]

    # subgroups: every single rank and a pair
    for g_ranks in ([0, 1], [WORLD - 1]) if WORLD > 2 else ([0, 1],):
        g = dist.new_group(g_ranks)
        if RANK in g_ranks:
            t = torch.ones(2, device=DEV) * (RANK + 1)
            dist.all_reduce(t, group=g)
            close(t, torch.ones(2) * sum(i + 1 for i in g_ranks), what=f"subgroup {g_ranks}")
            assert dist.get_backend(g) == "neuron"
    if WORLD == 4:
        sub, _ = dist.new_subgroups(group_size=2)
        t = torch.ones(1, device=DEV) * RANK
        dist.all_reduce(t, group=sub)
        base = (RANK // 2) * 2
        close(t, torch.tensor([float(base + base + 1)]), what="new_subgroups")

    _functional(DEV)
    dist.destroy_process_group()
    print("ok", RANK)


def _nccl_forms_on(device: torch.device):
    """Every argument form ProcessGroupNCCL accepts (its checks, not gloo's), each against a
    local CPU computation: element counts instead of shapes, uneven list collectives, complex
    and bool reductions, empty tensors."""
    p, r = WORLD, RANK
    ins = [rank_tensor(i, (1, 4, 4)) for i in range(p)]
    mine = ins[r].to(device)
    # all_gather_into_tensor: a flat output (Accelerate's gather), a stacked one, a 2-D one
    for shape in ((p * 16,), (p, 1, 4, 4), (p * 4, 4), (4, p * 4)):
        out = torch.empty(shape, device=device)
        dist.all_gather_into_tensor(out, mine)
        close(out.reshape(-1), torch.cat([x.reshape(-1) for x in ins]), what=f"all_gather_into_tensor {shape}")
    # ... the same through the functional collective (no Python frontend in between)
    import torch.distributed._functional_collectives as fc
    got = fc.all_gather_tensor(mine.reshape(16), 0, dist.group.WORLD)
    close(got, torch.cat([x.reshape(-1) for x in ins]), what="functional all_gather_tensor")
    # reduce_scatter_tensor: input and output of any shapes with the right element counts
    big = [rank_tensor(50 + i, (p * 6,)) for i in range(p)]
    out = torch.empty(2, 3, device=device)
    dist.reduce_scatter_tensor(out, big[r].reshape(p, 2, 3).to(device))
    close(out.reshape(-1), sum(big).reshape(p, 6)[r], what="reduce_scatter_tensor shapes")
    # all_reduce / broadcast / reduce: peers agree on element counts, not on shapes
    t = ins[r].reshape(16 if r % 2 else (4, 4)).to(device).clone()
    dist.all_reduce(t)
    close(t.reshape(-1), sum(ins).reshape(-1), what="all_reduce shapes differ")
    t = ins[r].reshape((2, 8) if r else (16,)).to(device).clone()
    dist.broadcast(t, src=0)
    close(t.reshape(-1), ins[0].reshape(-1), what="broadcast shapes differ")
    # all_gather list: outputs of another shape, and uneven sizes (rank i gives i + 1 rows)
    outs = [torch.empty(4, 4, device=device) for _ in range(p)]
    dist.all_gather(outs, mine)
    for i in range(p):
        close(outs[i], ins[i].reshape(4, 4), what="all_gather reshaped outputs")
    uneven = [torch.arange((i + 1) * 3, dtype=torch.float32).reshape(i + 1, 3) + 10 * i for i in range(p)]
    outs = [torch.empty(i + 1, 3, device=device) for i in range(p)]
    dist.all_gather(outs, uneven[r].to(device))
    for i in range(p):
        close(outs[i], uneven[i], what="all_gather uneven")
    outs = [torch.empty(i + 1, 3, device=device, dtype=torch.float8_e4m3fn) for i in range(p)]
    dist.all_gather(outs, uneven[r].to(torch.float8_e4m3fn).to(device))
    for i in range(p):
        close(outs[i].float(), uneven[i].to(torch.float8_e4m3fn).float(), what="all_gather uneven float8")
    # reduce_scatter list: inputs of another shape, and uneven sizes (rank j's part has j + 1 rows)
    parts = [[rank_tensor(200 + 10 * i + j, (2, 4)) for j in range(p)] for i in range(p)]
    out = torch.empty(8, device=device)
    dist.reduce_scatter(out, [x.to(device) for x in parts[r]])
    close(out, sum(parts[i][r] for i in range(p)).reshape(-1), what="reduce_scatter reshaped")
    parts = [[rank_tensor(300 + 10 * i + j, (j + 1, 2)) for j in range(p)] for i in range(p)]
    out = torch.empty(r + 1, 2, device=device)
    dist.reduce_scatter(out, [x.to(device) for x in parts[r]], op=dist.ReduceOp.AVG)
    close(out, sum(parts[i][r] for i in range(p)) / p, what="reduce_scatter uneven AVG")
    strided = torch.zeros(r + 1, 4, device=device)[:, ::2]
    dist.reduce_scatter(strided, [x.to(device) for x in parts[r]])
    close(strided, sum(parts[i][r] for i in range(p)), what="reduce_scatter uneven strided output")
    # all_to_all_single: no splits and a dim 0 that does not divide (elements do), and rows
    # of different shapes on the two sides
    x = torch.arange(p * 6, dtype=torch.float32).reshape(3, 2 * p) + 100 * r
    out = torch.empty(6 * p, device=device)
    dist.all_to_all_single(out, x.to(device))
    want = torch.cat([(torch.arange(p * 6, dtype=torch.float32) + 100 * i)[r * 6:(r + 1) * 6] for i in range(p)])
    close(out, want, what="all_to_all_single element split")
    x = torch.arange(p * 4, dtype=torch.float32).reshape(p * 2, 2) + 100 * r   # rows of 2
    out = torch.empty(p, 4, device=device)                                     # rows of 4
    dist.all_to_all_single(out, x.to(device), output_split_sizes=[1] * p, input_split_sizes=[2] * p)
    want = torch.stack([(torch.arange(p * 4, dtype=torch.float32) + 100 * i)[r * 4:(r + 1) * 4] for i in range(p)])
    close(out, want, what="all_to_all_single row shapes differ")
    # complex reductions (as their real views) and their refusal for MIN
    zs = [torch.complex(rank_tensor(400 + i, (5,)), rank_tensor(500 + i, (5,))) for i in range(p)]
    for op, ref in ((dist.ReduceOp.SUM, sum(zs)), (dist.ReduceOp.AVG, sum(zs) / p)):
        t = zs[r].to(device).clone()
        dist.all_reduce(t, op=op)
        close(torch.view_as_real(t.cpu()), torch.view_as_real(ref), what=f"complex all_reduce {op}")
    import torch.distributed._functional_collectives as fc
    got = fc.all_reduce(zs[r].to(device), "sum", dist.group.WORLD)
    close(torch.view_as_real(got.cpu()), torch.view_as_real(sum(zs)), what="functional complex all_reduce")
    zo = torch.empty(5, dtype=torch.complex64, device=device)
    dist.reduce_scatter_tensor(zo, torch.cat([zs[r]] * p).to(device))
    close(torch.view_as_real(zo.cpu()), torch.view_as_real(sum(zs)), what="complex reduce_scatter_tensor")
    try:
        dist.group.WORLD.allreduce([zs[r].to(device).clone()], dist.ReduceOp.MIN).wait()
    except ValueError as e:
        assert "complex" in str(e), e
    else:
        raise AssertionError("MIN on complex was accepted")
    # bool: SUM is a logical or and PRODUCT a logical and, as NCCL's uint8 MAX/MIN
    bs = [torch.tensor([i == 0, True, False, i == p - 1]) for i in range(p)]
    for op, ref in ((dist.ReduceOp.SUM, torch.stack(bs).any(0)), (dist.ReduceOp.PRODUCT, torch.stack(bs).all(0)),
                    (dist.ReduceOp.MAX, torch.stack(bs).any(0))):
        t = bs[r].to(device).clone()
        dist.all_reduce(t, op=op)
        assert torch.equal(t.cpu(), ref), (op, t, ref)
    # empty tensors
    e = torch.empty(0, 3, device=device)
    dist.all_reduce(e)
    dist.broadcast(e, src=0)
    dist.all_gather_into_tensor(torch.empty(0, device=device), e)
    print("nccl forms ok on", device.type, flush=True)


def scenario_nccl_forms():
    init()
    for device in (DEV, torch.device("cpu")):
        _nccl_forms_on(device)
    dist.destroy_process_group()
    print("ok", RANK)


def _functional(device):
    import torch.distributed._functional_collectives as fc
    group = dist.group.WORLD
    x = torch.arange(6., device=device).reshape(2, 3) + RANK
    full = torch.stack([torch.arange(6.).reshape(2, 3) + i for i in range(WORLD)])
    close(fc.wait_tensor(fc.all_reduce(x, "sum", group)), full.sum(0), what="fc.all_reduce")
    close(fc.wait_tensor(fc.all_gather_tensor(x, 0, group)), full.reshape(-1, 3), what="fc.all_gather")
    y = torch.arange(2. * WORLD * 3, device=device).reshape(2 * WORLD, 3) * (RANK + 1)
    ref = (torch.arange(2. * WORLD * 3).reshape(2 * WORLD, 3) * sum(range(1, WORLD + 1))).chunk(WORLD)[RANK]
    close(fc.wait_tensor(fc.reduce_scatter_tensor(y, "sum", 0, group)), ref, what="fc.reduce_scatter")
    z = torch.arange(WORLD * 2., device=device) + 100 * RANK
    a2a = fc.wait_tensor(fc.all_to_all_single(z, None, None, group))
    close(a2a, torch.cat([torch.arange(WORLD * 2.)[2 * RANK:2 * RANK + 2] + 100 * i for i in range(WORLD)]),
          what="fc.all_to_all_single")
    close(fc.wait_tensor(fc.broadcast(x, 0, group)), full[0], what="fc.broadcast")

    # inside torch.compile: aot_eager always, "neuron" when the compile backend is registered
    def fn(t):
        s = fc.all_reduce(t * 2, "sum", group)
        g = fc.all_gather_tensor(s + 1, 0, group)
        return fc.reduce_scatter_tensor(g, "avg", 0, group).sum(0) - 1
    eager = fn(x)
    from torch import _dynamo
    backends = ["aot_eager"]
    if "neuron" in _dynamo.list_backends(exclude_tags=()):
        backends.append("neuron")
    for be in backends:
        _dynamo.reset()
        out = torch.compile(fn, backend=be, fullgraph=True)(x)
        close(out, eager, what=f"compiled functional collectives ({be})")
    print("compiled with", backends)


# --- bad input -------------------------------------------------------------------------------
def _expect_transport():
    """The agreement transport the test asked for: shared memory by default on one host."""
    want = {"0": "off", "1": "shm", "gloo": "gloo"}[os.environ.get("TORCH_NEURONX_DIST_CHECK", "1")]
    got = dist.group.WORLD.check_transport
    assert got == want, f"agreement over {got}, expected {want}"
    print("transport", got)
    return got


def scenario_mismatch():
    init(timeout=20)
    _expect_transport()
    n = 4 if RANK == 0 else 5
    for what, fn in (
        ("shape", lambda: dist.all_reduce(torch.ones(n, device=DEV))),
        ("dtype", lambda: dist.all_reduce(torch.ones(4, device=DEV,
                                                     dtype=torch.float32 if RANK == 0 else torch.float64))),
        ("op", lambda: dist.all_reduce(torch.ones(4, device=DEV)) if RANK == 0
         else dist.broadcast(torch.ones(4, device=DEV), src=0)),
        ("all_gather", lambda: dist.all_gather_into_tensor(torch.empty(WORLD * n, device=DEV),
                                                           torch.ones(n, device=DEV))),
        ("splits", lambda: dist.all_to_all_single(
            # rank 1 sends 2 rows to rank 0, which expects 1
            torch.empty(2, device=DEV), torch.ones(2 if RANK == 0 else 3, device=DEV),
            output_split_sizes=[1, 1], input_split_sizes=[1, 1] if RANK == 0 else [2, 1])),
    ):
        t0 = time.monotonic()
        try:
            fn()
        except RuntimeError as e:
            msg = str(e)
            assert "neuron backend" in msg, msg
            assert ("mismatched" in msg or "disagree" in msg), msg
            assert time.monotonic() - t0 < 10, "error took too long"
            print(what, "->", msg.splitlines()[0][:160])
        else:
            raise AssertionError(f"{what} mismatch was not detected")
    # wrong device: a tensor on another rank's core, a meta tensor; local errors, no comm
    other = torch.device("neuron", (DEV.index + 1) % torch.neuron.device_count())
    for bad, needle in ((torch.ones(2, device=other), str(other)), (torch.ones(2, device="meta"), "meta")):
        try:
            dist.all_reduce(bad)
        except (RuntimeError, ValueError) as e:
            assert needle in str(e), str(e)
            print("wrong device ->", str(e)[:160])
        else:
            raise AssertionError("wrong device not detected")
    # mixing cpu and neuron in one collective
    try:
        dist.all_gather_into_tensor(torch.empty(WORLD * 2), torch.ones(2, device=DEV))
    except RuntimeError as e:
        assert "mixes" in str(e), str(e)
    else:
        raise AssertionError("device mix not detected")
    # the group still works after every error
    t = torch.ones(3, device=DEV)
    dist.all_reduce(t)
    close(t, torch.full((3,), float(WORLD)), what="after errors")
    dist.destroy_process_group()
    print("ok", RANK)


def scenario_dead_rank():
    init(timeout=float(os.environ.get("DIST_TIMEOUT", "10")))
    transport = _expect_transport()
    t = torch.ones(1 << 16, device=DEV)
    dist.all_reduce(t)
    if RANK == WORLD - 1:
        os._exit(3)  # dies without a word
    t0 = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(t)
    except RuntimeError as e:
        elapsed = time.monotonic() - t0
        assert "neuron backend" in str(e) and "rank" in str(e), str(e)
        assert "a peer rank died or closed its connection" in str(e), str(e)
        if transport == "shm":
            assert f"group rank(s) {WORLD - 1} exited" in str(e), str(e)
        print(f"survivor error after {elapsed:.1f}s: {str(e)[:300]}")
        assert elapsed < 15, elapsed
        os._exit(0)
    raise AssertionError("no error although a rank died")


def scenario_never_arrives():
    timeout = float(os.environ.get("DIST_TIMEOUT", "4"))
    init(timeout=timeout)
    transport = _expect_transport()
    t = torch.ones(8, device=DEV)
    dist.all_reduce(t)
    if RANK == WORLD - 1:
        time.sleep(timeout + 4)  # never calls the next collective in time (and exits after)
        os._exit(0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        elapsed = time.monotonic() - t0
        assert f"timed out after {timeout:g}s" in str(e), str(e)
        if transport == "shm":
            assert f"group rank(s) {WORLD - 1} did not reach collective #2" in str(e), str(e)
        assert timeout - 0.5 < elapsed < timeout + 5, elapsed
        print(f"timeout error after {elapsed:.1f}s: {str(e)[:300]}")
        os._exit(0)
    raise AssertionError("no timeout error")


def _agreement_files() -> list:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("torch_neuronx_agree_"))


def scenario_shm_groups():
    """Subgroups and several groups at once on the shared-memory agreement: results, a
    group with a rank that cannot map the segment, a mismatch inside a subgroup, back-to-back
    async collectives with ranks running at different speeds, a peer dying inside a
    subgroup."""
    import random
    init(timeout=20)
    _expect_transport()
    g01, g23, g123 = (dist.new_group(r) for r in ([0, 1], [2, 3], [1, 2, 3]))
    mine = [g for g, members in ((g01, (0, 1)), (g23, (2, 3)), (g123, (1, 2, 3))) if RANK in members]
    for g in mine:
        assert g.check_transport == "shm", g.check_transport
    # the segment is unlinked once every rank mapped it: nothing is left in /dev/shm
    dist.barrier()
    leftovers = [f for f in _agreement_files() if f.split("_")[3] == str(os.getpid())]
    assert not leftovers, leftovers

    # a rank that cannot map rank 0's segment (as when it runs on another host) makes the
    # whole group agree over gloo
    from torch_neuronx.distributed import shm_agreement
    real_attach = shm_agreement._attach
    if RANK == 2:
        shm_agreement._attach = lambda *args: (None, None)
    spread = dist.new_group()
    shm_agreement._attach = real_attach
    assert spread.check_transport == "gloo", spread.check_transport
    t = torch.full((3,), float(RANK), device=DEV)
    dist.all_reduce(t, group=spread)
    close(t, torch.full((3,), 6.0), what="group agreeing over gloo")

    # several groups at once, in the same order on every rank
    pair = g01 if RANK < 2 else g23
    for step in range(20):
        t = torch.full((5,), float(RANK + step), device=DEV)
        dist.all_reduce(t, group=pair)
        base = 0 if RANK < 2 else 2
        close(t, torch.full((5,), float(2 * base + 1 + 2 * step)), what=f"pair step {step}")
        if RANK in (1, 2, 3):
            u = torch.full((3,), float(RANK * step), device=DEV)
            dist.all_reduce(u, op=dist.ReduceOp.MAX, group=g123)
            close(u, torch.full((3,), float(3 * step)), what=f"g123 step {step}")
        w = torch.full((2,), float(RANK), device=DEV)
        dist.all_reduce(w)
        close(w, torch.full((2,), 6.0), what=f"world step {step}")

    # a mismatch inside a subgroup fails on its members only, with the subgroup's name
    if RANK in (1, 2, 3):
        try:
            dist.all_reduce(torch.ones(4 if RANK != 2 else 6, device=DEV), group=g123)
        except RuntimeError as e:
            assert "mismatched" in str(e) and g123.group_name in str(e), str(e)
            assert "rank 1: all_reduce(float32[6]|SUM)" in str(e), str(e)
            print("subgroup mismatch ->", str(e)[:200])
        else:
            raise AssertionError("subgroup mismatch not detected")
        v = torch.ones(2, device=DEV)
        dist.all_reduce(v, group=g123)
        close(v, torch.full((2,), 3.0), what="g123 after its mismatch")

    # back-to-back async collectives, each rank issuing at its own pace; the split sizes of
    # all_to_all_single travel with the agreement entries, so ring slots carry payloads of
    # different lengths
    rng = random.Random(RANK)
    works, checks = [], []
    for i in range(40):
        time.sleep(rng.random() * 0.004)
        kind = i % 3
        if kind == 0:
            t = torch.full((64 + i,), float(RANK + i), device=DEV)
            works.append(dist.all_reduce(t, async_op=True))
            checks.append((t, torch.full((64 + i,), float(6 + 4 * i)), f"async all_reduce {i}"))
        elif kind == 1:
            out = torch.empty(WORLD * 3, device=DEV)
            works.append(dist.all_gather_into_tensor(out, torch.full((3,), float(i * 10 + RANK),
                                                                     device=DEV), async_op=True))
            ref = torch.tensor([float(i * 10 + r) for r in range(WORLD) for _ in range(3)])
            checks.append((out, ref, f"async all_gather {i}"))
        else:
            # rank r sends r + 1 rows to every peer
            ins = torch.full((WORLD * (RANK + 1),), float(100 * RANK + i), device=DEV)
            out = torch.empty(sum(r + 1 for r in range(WORLD)), device=DEV)
            works.append(dist.all_to_all_single(out, ins, [r + 1 for r in range(WORLD)],
                                                [RANK + 1] * WORLD, async_op=True))
            ref = torch.cat([torch.full((r + 1,), float(100 * r + i)) for r in range(WORLD)])
            checks.append((out, ref, f"async all_to_all_single {i}"))
    for w in works:
        w.wait()
    for got, ref, what in checks:
        close(got, ref, what=what)
    # a mismatch between async collectives: the pending ones still complete
    first = torch.ones(8, device=DEV)
    w1 = dist.all_reduce(first, async_op=True)
    try:
        dist.all_reduce(torch.ones(8, device=DEV), op=dist.ReduceOp.MAX if RANK == 3 else dist.ReduceOp.SUM,
                        async_op=True)
    except RuntimeError as e:
        assert "mismatched" in str(e) and "rank 3: all_reduce(float32[8]|MAX)" in str(e), str(e)
    else:
        raise AssertionError("reduce op mismatch not detected")
    last = torch.ones(8, device=DEV)
    w3 = dist.all_reduce(last, async_op=True)
    w1.wait()
    w3.wait()
    close(first, torch.full((8,), 4.0), what="async before the mismatch")
    close(last, torch.full((8,), 4.0), what="async after the mismatch")
    print("async ok", RANK, flush=True)

    # a peer of a subgroup dies: its other members name it by group and global rank
    dist.barrier()
    if RANK == 3:
        os._exit(0)
    if RANK in (1, 2):
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2, device=DEV), group=g123)
        except RuntimeError as e:
            assert "died or closed its connection" in str(e), str(e)
            assert "group rank(s) 2 (global rank 3) exited" in str(e), str(e)
            assert time.monotonic() - t0 < 5, time.monotonic() - t0
            print("subgroup dead peer ->", str(e)[:300])
        else:
            raise AssertionError("dead subgroup peer not detected")
    os._exit(0)


def scenario_shm_ring():
    """The ring directly: ranks at random paces exchange thousands of entries (with payloads
    of varying length) and each must see exactly every peer's entry of that sequence number;
    a published entry whose payload does not match its tag (a torn write) is not taken."""
    import random
    from torch_neuronx.distributed import shm_agreement as shm
    init(timeout=20)
    g = dist.new_group()
    slots = g._agreement.slots
    assert slots is not None
    rng = random.Random(RANK)
    for seq in range(1, 3001):
        if rng.random() < 0.02:
            time.sleep(rng.random() * 0.003)
        fp = (seq * 2654435761) & ((1 << 56) - 1)
        extra = [seq, RANK] * (seq % (WORLD + 1))
        got = slots.exchange(seq, fp, extra, 20.0)
        for q, (f, ex) in enumerate(got):
            assert f == fp and ex == [seq, q] * (seq % (WORLD + 1)), (seq, q, f, ex)
    seq = 3001
    if RANK == 1:
        off = slots._offset(1, seq % 2)
        # a payload that belongs to no published entry, under the right sequence number
        shm._payload(0).pack_into(slots._mm, off + 8, 7, 12345)
        shm._HDR.pack_into(slots._mm, off, seq, 0)
        time.sleep(0.3)
    t0 = time.monotonic()
    got = slots.exchange(seq, 99, [], 20.0)
    assert [f for f, _ in got] == [99] * WORLD, got
    if RANK == 0:
        assert time.monotonic() - t0 > 0.2, "took the torn entry"
    dist.destroy_process_group()
    assert g._agreement.slots is None
    print("ring ok", RANK)


def scenario_too_many():
    try:
        dist.init_process_group("neuron", timeout=timedelta(seconds=20))
    except RuntimeError as e:
        assert "neuron device(s) are visible" in str(e), str(e)
        print("error:", e)
        sys.exit(7)
    sys.exit(0)



# --- parallelisms ----------------------------------------------------------------------------
STEPS, N, SEQ, LR = 3, 4, 8, 0.05


def _local_batch(step, dp_rank=None, dp_size=None):
    x, y = M.batch(step, N, SEQ)
    dp_rank = RANK if dp_rank is None else dp_rank
    dp_size = WORLD if dp_size is None else dp_size
    return x.chunk(dp_size)[dp_rank].to(DEV), y.chunk(dp_size)[dp_rank].to(DEV)


def _mean_over(value: torch.Tensor, group=None) -> float:
    t = value.detach().reshape(1).clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    return t.item()


def _full_state(model) -> dict:
    from torch.distributed.tensor import DTensor
    out = {}
    for k, v in model.state_dict().items():
        k = k.replace("module.", "").replace("_orig_mod.", "")
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu")
    return out


def _compare(losses, state, ref_losses, ref_state, atol=1e-5, what=""):
    close(torch.tensor(losses), torch.tensor(ref_losses), atol=atol, rtol=atol, what=f"{what} losses")
    for k, v in ref_state.items():
        close(state[k], v, atol=atol, rtol=atol, what=f"{what} {k}")


class _WithUnused(torch.nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.gpt(x)


def scenario_ddp():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    init()
    ref_losses, ref_state = M.reference_train(STEPS, N, SEQ, LR)

    def custom_hook(state, bucket):
        # a Python hook: the future must resolve to the device tensor
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(WORLD))

    for variant in ("buckets", "bucket_view", "no_sync", "unused", "hook_fp16", "hook_custom"):
        torch.manual_seed(0)
        gpt = M.GPT()
        module = (_WithUnused(gpt) if variant == "unused" else gpt).to(DEV)
        ddp = DDP(module, bucket_cap_mb=0.01, find_unused_parameters=(variant == "unused"),
                  gradient_as_bucket_view=(variant == "bucket_view"))
        if variant == "hook_fp16":
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        elif variant == "hook_custom":
            ddp.register_comm_hook(None, custom_hook)
        opt = M.make_optim(ddp.parameters(), LR, "sgd")
        losses = []
        for step in range(STEPS):
            x, y = _local_batch(step)
            if variant == "no_sync":
                # gradient accumulation: sync only on the last micro-batch
                with ddp.no_sync():
                    l0 = M.lm_loss(ddp(x[:1]), y[:1]) / 2
                    l0.backward()
                l1 = M.lm_loss(ddp(x[1:]), y[1:]) / 2
                l1.backward()
                loss = l0 + l1
            else:
                loss = M.lm_loss(ddp(x), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_mean_over(loss))
        state = {k.replace("gpt.", ""): v for k, v in _full_state(ddp).items()}
        tol = 1e-3 if variant == "hook_fp16" else 1e-5
        _compare(losses, state, ref_losses, ref_state, atol=tol, what=f"DDP {variant}")
        assert next(ddp.parameters()).device == DEV
        print("DDP", variant, "ok", flush=True)
    dist.destroy_process_group()
    print("ok", RANK)


def _fsdp_model(mesh, mp=None, reshard=True, layers=2):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = M.GPT(layers=layers).to(DEV)
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **kw)
    return model


def _train(model, steps=STEPS, clip=None, dp_rank=None, dp_size=None, opt="sgd", dp_group=None,
           optimizer=None):
    optimizer = optimizer or M.make_optim(model.parameters(), LR, opt)
    losses = []
    for step in range(steps):
        x, y = _local_batch(step, dp_rank, dp_size)
        loss = M.lm_loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over(loss, dp_group))
    return losses


def scenario_fsdp(ckpt_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Shard
    import torch.distributed.checkpoint as dcp
    mesh = init_device_mesh("neuron", (WORLD,))   # creates the default group: neuron backend
    # no backend named: PyTorch reports "undefined", as for CUDA; the group is ours
    assert dist.group.WORLD.name() == "neuron" and torch.neuron.current_device() == DEV.index

    # FSDP2, fp32, gradient clipping, full state dict
    ref_losses, ref_state = M.reference_train(STEPS, N, SEQ, LR, clip=0.5)
    model = _fsdp_model(mesh)
    losses = _train(model, clip=0.5)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if RANK == 0:
        _compare(losses, {k: v for k, v in full.items()}, ref_losses, ref_state, what="FSDP2")
    # resharded after forward: parameters are sharded DTensors again once forward returns
    with torch.no_grad():
        model(_local_batch(0)[0])
    w = model.layers[0].attention.wq.weight
    assert isinstance(w, DTensor) and w.placements == (Shard(0),), w
    assert w.to_local().shape[0] == 32 // WORLD
    print("FSDP2 ok", flush=True)

    # DCP: save the FSDP-sharded model, load it into a tensor-parallel model (resharding)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=ckpt_dir)
    tp_mesh = init_device_mesh("neuron", (WORLD,), mesh_dim_names=("tp",))
    torch.manual_seed(123)
    tp_model = M.apply_tp(M.GPT().to(DEV), tp_mesh)
    sd = {"model": get_model_state_dict(tp_model)}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(tp_model, sd["model"])
    loaded = _full_state(tp_model)
    for k, v in ref_state.items():
        close(loaded[k], v, atol=1e-5, what=f"DCP reshard FSDP->TP {k}")
    print("DCP ok", flush=True)

    # mixed precision: bf16 compute, fp32 reduction; close to the fp32 reference
    ref_losses, ref_state = M.reference_train(STEPS, N, SEQ, LR)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _fsdp_model(mesh, mp=mp, reshard=False)
    losses = _train(model)
    state = _full_state(model)
    assert all(v.dtype == torch.float32 for v in state.values())
    _compare(losses, state, ref_losses, ref_state, atol=3e-2, what="FSDP2 bf16")
    print("FSDP2 bf16 ok", flush=True)

    # ZeRO: DDP + ZeroRedundancyOptimizer(AdamW), optimizer state sharded across ranks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    ref_losses, ref_state = M.reference_train(STEPS, N, SEQ, 1e-2, opt="adam")
    torch.manual_seed(0)
    ddp = DDP(M.GPT().to(DEV))
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2,
                                   foreach=False)
    losses = _train(ddp, optimizer=zero)
    _compare(losses, {k.replace("module.", ""): v for k, v in _full_state(ddp).items()},
             ref_losses, ref_state, atol=1e-4, what="ZeRO")
    n_local = sum(len(v) for v in zero.optim.state.values()) if zero.optim.state else 0
    n_total = len(list(ddp.parameters()))
    assert 0 < len(zero.optim.state) < n_total, (n_local, n_total)
    zero.consolidate_state_dict(to=0)
    if RANK == 0:
        assert len(zero.state_dict()["state"]) == n_total
    print("ZeRO ok", flush=True)

    scenario_simple_fsdp(mesh)
    dist.destroy_process_group()
    print("ok", RANK)


def _simple_fsdp(model, mesh):
    """SimpleFSDP: each parameter is a Shard(0) DTensor; a parametrization all-gathers it for
    compute, and its backward reduce-scatters (averages) the gradient."""
    import torch.nn.utils.parametrize as P
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    class ReplicateComputation(torch.nn.Module):
        def forward(self, x):
            return x.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial("avg"),))

    for mod in list(model.modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
            P.register_parametrization(mod, name, ReplicateComputation(), unsafe=True)
    return model


def scenario_simple_fsdp_compile():
    from torch.distributed.device_mesh import init_device_mesh
    init(timeout=120)
    scenario_simple_fsdp(init_device_mesh("neuron", (WORLD,)), modes=("compile",))
    dist.destroy_process_group()
    print("ok", RANK)


def scenario_simple_fsdp(mesh, modes=("eager",)):
    ref_losses, ref_state = M.reference_train(STEPS, N, SEQ, LR)
    results = {}
    for mode in modes:
        torch.manual_seed(0)
        model = _simple_fsdp(M.GPT().to(DEV), mesh)
        run = model if mode == "eager" else torch.compile(model, backend="aot_eager")
        opt = M.make_optim(model.parameters(), LR, "sgd")
        losses = _train(run, optimizer=opt)
        state = {}
        for k, v in model.named_parameters():
            state[k.replace(".parametrizations", "").replace(".original", "")] = v.full_tensor().to("cpu")
        _compare(losses, state, ref_losses, {k: v for k, v in ref_state.items() if k in state},
                 atol=1e-5, what=f"SimpleFSDP {mode}")
        results[mode] = losses
        print("SimpleFSDP", mode, "ok", flush=True)


def scenario_tp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    init(timeout=120)
    mesh = init_device_mesh("neuron", (WORLD,), mesh_dim_names=("tp",))
    ref_losses, ref_state = M.reference_train(STEPS, N, SEQ, LR)
    for sp in (False, True):
        torch.manual_seed(0)
        model = M.apply_tp(M.GPT().to(DEV), mesh, sequence_parallel=sp)
        assert isinstance(model.layers[0].attention.wq.weight, DTensor)
        losses = _train(model, dp_rank=0, dp_size=1)   # every TP rank sees the whole batch
        _compare(losses, _full_state(model), ref_losses, ref_state, atol=1e-5,
                 what=f"TP sequence_parallel={sp}")
        print("TP", "SP" if sp else "", "ok", flush=True)

    # DTensor ops and redistribution, against the same math on full CPU tensors
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
    da = distribute_tensor(a.to(DEV), mesh, [Shard(0)])
    db = distribute_tensor(b.to(DEV), mesh, [Replicate()])
    close((da @ db).full_tensor(), a @ b, atol=1e-5, what="Shard(0) @ Replicate")
    dc = distribute_tensor(a.to(DEV), mesh, [Shard(1)])
    dd = distribute_tensor(b.to(DEV), mesh, [Shard(0)])
    prod = dc @ dd
    assert prod.placements == (Partial(),), prod.placements
    close(prod.redistribute(placements=[Replicate()]).to_local(), a @ b, atol=1e-5, what="Partial->Replicate")
    close(prod.redistribute(placements=[Shard(0)]).full_tensor(), a @ b, atol=1e-5, what="Partial->Shard")
    s1 = da.redistribute(placements=[Shard(1)])
    assert s1.to_local().shape == (8, 6 // WORLD)
    close(s1.full_tensor(), a, what="Shard(0)->Shard(1)")
    close(da.redistribute(placements=[Replicate()]).to_local(), a, what="Shard->Replicate")
    close((da.sum(dim=0)).full_tensor(), a.sum(0), atol=1e-5, what="sum over sharded dim")
    close(torch.nn.functional.softmax(da, dim=1).full_tensor(), a.softmax(1), atol=1e-6, what="softmax")
    uneven = distribute_tensor(torch.arange(7.).to(DEV), mesh, [Shard(0)])
    close(uneven.full_tensor(), torch.arange(7.), what="uneven shard")
    print("DTensor ok", flush=True)

    scenario_pipeline()
    dist.destroy_process_group()
    print("ok", RANK)


class _Stage(torch.nn.Module):
    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = torch.nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def scenario_pipeline():
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)
    layers, micro = 4, 4
    x, y = M.batch(0, N, SEQ)
    torch.manual_seed(0)
    ref = M.GPT(layers=layers)
    ref_mb_losses = [M.lm_loss(ref(xm), ym).item() for xm, ym in zip(x.chunk(micro), y.chunk(micro))]
    M.lm_loss(ref(x), y).backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}

    for name, cls, per_rank in (("GPipe", ScheduleGPipe, 1), ("1F1B", Schedule1F1B, 1),
                                ("Interleaved1F1B", ScheduleInterleaved1F1B, 2)):
        n_stages = WORLD * per_rank
        torch.manual_seed(0)
        model = M.GPT(layers=layers)
        per = layers // n_stages
        stage_ids = [RANK + WORLD * k for k in range(per_rank)]
        stages, mods = [], []
        for sid in stage_ids:
            mod = _Stage(model, sid * per, (sid + 1) * per, sid == 0, sid == n_stages - 1).to(DEV)
            mods.append(mod)
            stages.append(PipelineStage(mod, sid, n_stages, DEV))
        sched = (cls(stages, n_microbatches=micro, loss_fn=M.lm_loss) if per_rank > 1
                 else cls(stages[0], n_microbatches=micro, loss_fn=M.lm_loss))
        losses = []
        has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
        args = (x.to(DEV),) if has_first else ()
        kw = {"target": y.to(DEV), "losses": losses} if has_last else {}
        sched.step(*args, **kw)
        if has_last:
            close(torch.tensor([l.item() for l in losses]), torch.tensor(ref_mb_losses), atol=1e-5,
                  what=f"pipeline {name} losses")
        for mod in mods:
            for k, p in mod.named_parameters():
                key = k.replace("layers.", "layers.", 1)
                close(p.grad, ref_grads[key], atol=1e-5, what=f"pipeline {name} grad {key}")
        print("pipeline", name, "ok", flush=True)


def scenario_fsdp_tp_2d(ckpt_dir):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed.checkpoint as dcp
    init(timeout=120)
    mesh = init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh.get_group("dp").name() == "neuron"
    ref_losses, ref_state = M.reference_train(STEPS, N, SEQ, LR, clip=1.0)
    torch.manual_seed(0)
    model = M.apply_tp(M.GPT().to(DEV), mesh["tp"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh["dp"]
    losses = _train(model, clip=1.0, dp_rank=dp.get_local_rank(), dp_size=dp.size(),
                    dp_group=dp.get_group())
    _compare(losses, _full_state(model), ref_losses, ref_state, atol=1e-5, what="FSDP+TP 2-D")
    print("2-D FSDP+TP ok", flush=True)

    # DCP: save 2-D sharded, load into a 4-way FSDP model
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=ckpt_dir)
    flat = init_device_mesh("neuron", (WORLD,))
    torch.manual_seed(99)
    other = M.GPT().to(DEV)
    for layer in other.layers:
        fully_shard(layer, mesh=flat)
    fully_shard(other, mesh=flat)
    sd = {"model": get_model_state_dict(other)}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_model_state_dict(other, sd["model"])
    got = _full_state(other)
    for k, v in ref_state.items():
        close(got[k], v, atol=1e-5, what=f"DCP 2-D -> FSDP {k}")
    print("DCP 2-D reshard ok", flush=True)

    # four ranks: all_to_all with uneven splits and subgroups on the mesh's groups
    t = torch.ones(3, device=DEV) * RANK
    dist.all_reduce(t, group=mesh.get_group("tp"))
    tp_peers = dist.get_process_group_ranks(mesh.get_group("tp"))
    close(t, torch.ones(3) * sum(tp_peers), what="tp group all_reduce")
    dist.destroy_process_group()
    print("ok", RANK)


# --- DTensor random ops: the generator's (seed, offset) state gives each shard its part ---------
def scenario_dtensor_random():
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    init()
    mesh = init_device_mesh("neuron", (WORLD,))
    rows = 8 * WORLD
    # The reference: the same draws on one device, no sharding.
    torch.manual_seed(5)
    full_u = torch.rand(rows, 64, device=DEV).cpu()
    full_n = torch.randn(rows, 64, device=DEV).cpu()
    after = torch.rand(16, device=DEV).cpu()

    torch.manual_seed(5)
    dt = distribute_tensor(torch.zeros(rows, 64, device=DEV), mesh, [Shard(0)])
    dt.uniform_()
    mine = slice(8 * RANK, 8 * (RANK + 1))
    assert torch.equal(dt.to_local().cpu(), full_u[mine]), "Shard(0) uniform_ != its rows of one draw"
    dn = distribute_tensor(torch.zeros(rows, 64, device=DEV), mesh, [Shard(0)])
    dn.normal_()
    assert torch.equal(dn.to_local().cpu(), full_n[mine]), "Shard(0) normal_ != its rows of one draw"
    # Every rank leaves the region at the whole tensor's end, so plain draws agree again.
    assert torch.equal(torch.rand(16, device=DEV).cpu(), after), "ranks disagree after the region"

    torch.manual_seed(5)
    dr = distribute_tensor(torch.zeros(rows, 64, device=DEV), mesh, [Replicate()])
    dr.uniform_()
    assert torch.equal(dr.to_local().cpu(), full_u), "Replicate uniform_ != one draw"
    dist.destroy_process_group()
    print("dtensor random ok", RANK, flush=True)


def scenario_device_id():
    """`init_process_group(device_id=...)` with no backend named, as recent PyTorch guides
    write it, then a 2-D mesh (its subgroups) and an FSDP2 step on it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(device_id=DEV, timeout=timedelta(seconds=60))
    assert dist.get_backend() == "neuron", dist.get_backend()
    x = rank_tensor(RANK).to(DEV)
    dist.all_reduce(x)
    close(x, sum(rank_tensor(r) for r in range(WORLD)).to(DEV), what="all_reduce")
    mesh = init_device_mesh("neuron", (1, WORLD), mesh_dim_names=("dp", "shard"))
    y = torch.full((2,), float(RANK), device=DEV)
    dist.all_reduce(y, group=mesh["shard"].get_group())
    close(y, torch.full((2,), float(sum(range(WORLD))), device=DEV), what="mesh subgroup")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(DEV)
    fully_shard(model, mesh=mesh["shard"])
    model(torch.randn(4, 8, device=DEV)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    dist.destroy_process_group()
    print("device_id ok", RANK, flush=True)


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1]](*sys.argv[2:])
