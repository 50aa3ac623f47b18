"""Neuron tensors through torch.multiprocessing and DataLoader workers: shared, as CUDA's are
(the receiver sees the same memory on the same device index), never a hung receiver."""
import torch
import torch.multiprocessing as mp

DEV = "neuron"


def _child(q, r):
    t, p = q.get(timeout=120)
    r.put((str(t.device), t.cpu().tolist(), type(p).__name__, p.requires_grad))
    t.mul_(10)
    torch.neuron.synchronize()
    r.put("written")


def test_queue_shares_a_neuron_tensor_with_a_spawned_process():
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    x = torch.arange(6.0, device="neuron:1").reshape(2, 3)[:, 1:]  # a view: offset and strides
    p = torch.nn.Parameter(torch.ones(3, device=DEV))
    allocated = torch.neuron.memory_allocated(1)
    proc = ctx.Process(target=_child, args=(q, r))
    proc.start()
    try:
        q.put((x, p))
        device, values, ptype, grad = r.get(timeout=120)
        assert device == "neuron:1" and values == [[1.0, 2.0], [4.0, 5.0]]
        assert ptype == "Parameter" and grad
        assert r.get(timeout=120) == "written"
        assert x.cpu().tolist() == [[10.0, 20.0], [40.0, 50.0]]  # the child's write, seen here
        assert torch.neuron.memory_allocated(1) == allocated  # moved to shared memory, same count
        x.add_(1)  # the device keeps using the buffer in place
        assert x.cpu().tolist() == [[11.0, 21.0], [41.0, 51.0]]
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


class _Dataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.full((2,), float(i), device=DEV)


def test_dataloader_workers_return_neuron_tensors():
    # Spawned workers, as CUDA requires for device tensors in workers (a forked child of a
    # process whose runtime threads are running is not supported, as on CUDA).
    for context in ("spawn",):
        dl = torch.utils.data.DataLoader(_Dataset(), batch_size=2, num_workers=1,
                                         multiprocessing_context=context)
        batches = list(dl)
        assert [b.device.type for b in batches] == [DEV, DEV]
        assert [b.cpu().tolist() for b in batches] == [[[0.0, 0.0], [1.0, 1.0]], [[2.0, 2.0], [3.0, 3.0]]]
