"""FlexAttention on neuron: a block-sparse attention op, forward and backward.

``torch.nn.attention.flex_attention`` reaches compiled graphs as the ``flex_attention``
higher-order op, carrying the ``score_mod`` and ``mask_mod`` subgraphs and a ``BlockMask``
(per query block: the key/value blocks that are partly masked and those that are fully
visible). ``rewrite`` replaces it in the Dynamo graph by ``torch.ops.neuron.flex_attention``,
whose backward is ``torch.ops.neuron.flex_attention_backward`` (registered autograd), so
AOTAutograd produces forward and backward graphs and Inductor calls the ops as kernels.

The op walks the query blocks; for each it gathers only the key/value blocks the block
mask lists for it (the union over batch and heads), computes scores for those blocks,
applies ``score_mod`` (vectorised with vmap, as PyTorch's reference does) and ``mask_mod``
(partial blocks only), and a softmax over the visited blocks. Blocks the mask leaves out
are never loaded or multiplied: a causal mask does about half the work of a full one.
The backward recomputes each query block's forward under autograd (as flash attention
recomputes scores) and back-propagates through it, so any differentiable ``score_mod``
works, including captured buffers that require grad.

The subgraphs cannot be operator arguments, so they live in a registry keyed by a hash
of their code; the key is a string argument of the op. ``rewrite`` runs on every
compile, also when the compiled graph comes from the persistent cache, so a key is always
registered in the process that runs the op.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import pickle
import zlib

import torch

_FN_REGISTRY: dict = {}
_LN2 = math.log(2.0)


def _gm_key(gm) -> str:
    h = hashlib.sha256()
    if gm is None:
        return "none"
    h.update(gm.code.encode())
    for name, t in sorted(list(gm.named_buffers()) + list(gm.named_parameters())):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    for name in sorted(n.target for n in gm.graph.nodes if n.op == "get_attr"):
        sub = getattr(gm, name, None)
        if isinstance(sub, torch.fx.GraphModule):
            h.update(_gm_key(sub).encode())
        elif isinstance(sub, torch.Tensor):
            h.update(sub.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def _register_fns(score_mod, mask_mod) -> str:
    key = f"{_gm_key(score_mod)}-{_gm_key(mask_mod)}"
    _FN_REGISTRY[key] = (score_mod, mask_mod)
    return key


def _identity_score(score, b, h, q, kv, *bufs):
    return score


def _split(score_bufs, mask_bufs, is_int):
    """The captured values of score_mod and mask_mod as the ops take them: their tensors, the
    integers among them (sizes a dynamic-shape graph captures), and each integer's slot:
    p for position p of score_mod's, -1 - p for position p of mask_mod's."""
    ints, slots = [], []
    for sign, bufs in ((1, score_bufs), (-1, mask_bufs)):
        for p, b in enumerate(bufs):
            if is_int(b):
                ints.append(b)
                slots.append(p if sign > 0 else -1 - p)
    keep = [[b for b in bufs if not is_int(b)] for bufs in (score_bufs, mask_bufs)]
    return keep[0], keep[1], ints, slots


def _join(score_tensors, mask_tensors, ints, slots):
    score, mask = list(score_tensors), list(mask_tensors)
    for value, slot in sorted(zip(ints, slots), key=lambda e: abs(e[1] + 0.5)):
        if slot >= 0:
            score.insert(slot, value)
        else:
            mask.insert(-1 - slot, value)
    return score, mask


def _fns(key: str):
    try:
        return _FN_REGISTRY[key]
    except KeyError:
        if key.startswith("fx:"):
            # A graph Inductor loaded from its cache names its functions by value.
            _FN_REGISTRY[key] = pickle.loads(zlib.decompress(base64.b64decode(key[3:])))
            return _FN_REGISTRY[key]
        raise RuntimeError(f"neuron flex_attention: the score_mod/mask_mod of key {key!r} are "
                           "not registered in this process (the graph must be compiled by "
                           "the neuron backend)") from None


def _members(num, idx, n_blocks):
    """[..., n_blocks] bool: which kv blocks the first ``num`` entries of ``idx`` list."""
    listed = torch.arange(idx.shape[-1]) < num[..., None]
    counts = torch.zeros(*idx.shape[:-1], n_blocks, dtype=torch.int32)
    counts.scatter_add_(-1, idx.long().clamp(0, n_blocks - 1), listed.int())
    return counts > 0


def _attend(q, k, v, kv_num, kv_idx, full_num, full_idx, score_bufs, mask_bufs, key,
            scale, q_block, kv_block):
    """Differentiable block-sparse attention; returns (out, lse, max) in natural-log units."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    score_mod, mask_mod = _fns(key)
    score_mod = score_mod or _identity_score
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq != Hkv:   # grouped-query attention: each kv head serves Hq // Hkv query heads
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    if k.shape[0] != B:
        k, v = k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:])
    wp = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    # Block bookkeeping is tiny and decides the loop structure: read it on the host.
    kv_num_c, kv_idx_c = kv_num.cpu(), kv_idx.cpu()
    full_num_c = full_num.cpu() if full_num is not None else None
    full_idx_c = full_idx.cpu() if full_idx is not None else None
    n_kv_blocks = -(-S // kv_block)
    # score_mod / mask_mod are written for scalars; broadcasting index tensors laid out
    # along [b, h, q, kv] evaluates them for a whole tile at once. (PyTorch's reference
    # uses vmap, which is not available here: compiled graphs run with functorch off.)
    b_idx = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h_idx = torch.arange(Hq, device=dev).view(1, Hq, 1, 1)
    outs, lses, maxes = [], [], []
    for qb in range(-(-L // q_block)):
        q0, q1 = qb * q_block, min(L, (qb + 1) * q_block)
        qi = min(qb, kv_num_c.shape[-1] - 1)
        # Membership of each kv block for every (b, h) of the mask, partial and full.
        part = _members(kv_num_c[..., qi], kv_idx_c[..., qi, :], n_kv_blocks)
        full = (_members(full_num_c[..., qi], full_idx_c[..., qi, :], n_kv_blocks)
                if full_num_c is not None else torch.zeros_like(part))
        blocks = torch.nonzero((part | full).flatten(0, 1).any(0)).flatten().tolist()
        qs = q[:, :, q0:q1].to(wp)
        m_pos = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
        if not blocks:
            outs.append(torch.zeros(B, Hq, q1 - q0, v.shape[-1], dtype=q.dtype, device=dev))
            lses.append(torch.full((B, Hq, q1 - q0), -math.inf, dtype=wp, device=dev))
            maxes.append(torch.full((B, Hq, q1 - q0), -math.inf, dtype=wp, device=dev))
            continue
        n_pos = torch.cat([torch.arange(j * kv_block, min(S, (j + 1) * kv_block))
                           for j in blocks]).to(dev)
        ks = k.index_select(2, n_pos).to(wp)
        vs = v.index_select(2, n_pos)
        scores = (qs @ ks.transpose(-2, -1)) * scale
        n_b = n_pos.view(1, 1, 1, -1)
        with TransformGetItemToIndex():
            modded = score_mod(scores, b_idx, h_idx, m_pos, n_b, *score_bufs)
            allowed = mask_mod(b_idx, h_idx, m_pos, n_b, *mask_bufs)
        modded = modded.to(wp).expand_as(scores)
        allowed = allowed.expand(B, -1, *scores.shape[2:]) if allowed.dim() == 4 else allowed
        # Per (b, h): full blocks are visible as a whole, partial ones where mask_mod says
        # so, unlisted ones not at all.
        sizes = [min(S, (j + 1) * kv_block) - j * kv_block for j in blocks]
        is_full = full[:, :, blocks].repeat_interleave(torch.tensor(sizes), dim=-1)
        is_part = part[:, :, blocks].repeat_interleave(torch.tensor(sizes), dim=-1)
        is_full, is_part = is_full.to(dev)[:, :, None, :], is_part.to(dev)[:, :, None, :]
        allowed = is_full | (is_part & allowed)
        modded = modded.masked_fill(~allowed, -math.inf)
        row_max = modded.amax(-1, keepdim=True)
        safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(modded - safe_max.detach())
        denom = p.sum(-1, keepdim=True)
        out = (p / torch.where(denom == 0, torch.ones_like(denom), denom)).to(q.dtype) @ vs
        # (the row maximum detached, as in p: the logsumexp's gradient is the softmax alone;
        # log of 1 where nothing is visible, so it meets no infinite slope in the branch
        # `where` discards)
        lse = torch.where(denom == 0, torch.full_like(denom, -math.inf),
                          torch.log(torch.where(denom == 0, torch.ones_like(denom), denom))
                          + safe_max.detach())
        outs.append(out)
        lses.append(lse.squeeze(-1))
        maxes.append(row_max.squeeze(-1))
    return torch.cat(outs, 2), torch.cat(lses, 2), torch.cat(maxes, 2)


def _is_identity(gm) -> bool:
    """Whether a score_mod graph returns the score unchanged (no score_mod given)."""
    if gm is None:
        return True
    graph = getattr(gm, "graph", None)
    if graph is None:
        return False
    nodes = list(graph.nodes)
    places = [n for n in nodes if n.op == "placeholder"]
    outs = [n for n in nodes if n.op == "output"]
    if not places or len(outs) != 1 or len(nodes) != len(places) + 1:
        return False
    ret = outs[0].args[0]
    ret = ret[0] if isinstance(ret, (tuple, list)) and len(ret) == 1 else ret
    return ret is places[0]


@contextlib.contextmanager
def _as_nkilib(kind, q, k, kv_num, full_num, key, kv_block):
    """Charges the call as NKI-lib's FlashAttention kernel visiting the blocks the block
    mask lists (docs/nkilib.md) instead of the ATen ops that compute it here, when the
    kernel covers it (no score_mod; any mask_mod). Otherwise the ops are charged as usual."""
    from .. import cost_model
    from ..kernels import nkilib_routes as routes
    secs = None
    if not _is_identity(_fns(key)[0]):
        routes._decline(f"flex_attention ({kind})", "a score_mod")
    else:
        B, H, L, d = q.shape
        n_kv = -(-k.shape[2] // kv_block)
        visited = kv_num.cpu().float().mean().item()
        if full_num is not None:
            visited += full_num.cpu().float().mean().item()
        secs = routes.flex_seconds(kind, B, H, L, k.shape[2], d, cost_model.priced_dtype(q.dtype),
                                   min(1.0, visited / n_kv))
    if secs is None:
        yield
        return
    with routes.charged_as(q.device, "flex_attention" + ("_backward" if kind == "bwd" else ""),
                           secs[0], engine="tensor", flops=secs[1]):
        yield


_lib = None


def _define_ops() -> None:
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("neuron", "FRAGMENT")
    lib.define(
        "flex_attention(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, Tensor kv_indices, "
        "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor[] score_buffers, "
        "Tensor[] mask_buffers, SymInt[] captured_ints, int[] int_slots, str fn_key, "
        "float scale, int q_block, int kv_block) -> (Tensor, Tensor, Tensor)")
    lib.define(
        "flex_attention_backward(Tensor q, Tensor k, Tensor v, Tensor grad_out, "
        "Tensor? grad_logsumexp, Tensor kv_num_blocks, Tensor kv_indices, "
        "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor[] score_buffers, "
        "Tensor[] mask_buffers, SymInt[] captured_ints, int[] int_slots, str fn_key, "
        "float scale, int q_block, int kv_block) -> (Tensor, Tensor, Tensor, Tensor[])")

    def fwd(q, k, v, kv_num, kv_idx, full_num, full_idx, score_bufs, mask_bufs, ints, slots,
            key, scale, q_block, kv_block):
        score_bufs, mask_bufs = _join(score_bufs, mask_bufs, ints, slots)
        with torch.no_grad(), _as_nkilib("fwd", q, k, kv_num, full_num, key, kv_block):
            out, lse, mx = _attend(q, k, v, kv_num, kv_idx, full_num, full_idx, score_bufs,
                                   mask_bufs, key, scale, q_block, kv_block)
        # Same units as PyTorch's flex_attention op: log2 (the caller multiplies by ln 2).
        return out, (lse / _LN2).float(), (mx / _LN2).float()

    def bwd(q, k, v, grad_out, grad_lse, kv_num, kv_idx, full_num, full_idx, score_bufs,
            mask_bufs, ints, slots, key, scale, q_block, kv_block):
        with torch.enable_grad(), _as_nkilib("bwd", q, k, kv_num, full_num, key, kv_block):
            qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
            bufs = [b.detach().requires_grad_(b.is_floating_point()) for b in score_bufs]
            all_score, all_mask = _join(bufs, mask_bufs, ints, slots)
            out, lse, _ = _attend(qd, kd, vd, kv_num, kv_idx, full_num, full_idx, all_score,
                                  all_mask, key, scale, q_block, kv_block)
            wrt = [qd, kd, vd] + [b for b in bufs if b.requires_grad]
            # A logsumexp the caller used (Transformers returns it off the CPU) adds its
            # gradient, in the forward's log2 units.
            outs, grads_in = [out], [grad_out]
            if grad_lse is not None:
                outs.append((lse / _LN2).float())
                grads_in.append(grad_lse)
            grads = torch.autograd.grad(outs, wrt, grads_in, allow_unused=True)
        # Each gradient in its input's layout, as the fake says (Inductor checks the strides).
        grads = [torch.zeros_like(t) if g is None else
                 g if g.stride() == t.stride() else torch.empty_like(t).copy_(g)
                 for g, t in zip(grads, wrt)]
        it = iter(grads[3:])
        buf_grads = [next(it) if b.requires_grad else torch.zeros_like(b) for b in bufs]
        return grads[0], grads[1], grads[2], buf_grads

    def fwd_fake(q, k, v, kv_num, kv_idx, full_num, full_idx, score_bufs, mask_bufs, ints,
                 slots, key, scale, q_block, kv_block):
        B, H, L, _ = q.shape
        out = q.new_empty(B, H, L, v.shape[-1])
        return out, q.new_empty(B, H, L, dtype=torch.float32), \
            q.new_empty(B, H, L, dtype=torch.float32)

    def bwd_fake(q, k, v, grad_out, grad_lse, kv_num, kv_idx, full_num, full_idx, score_bufs,
                 mask_bufs, ints, slots, key, scale, q_block, kv_block):
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                [torch.empty_like(b) for b in score_bufs])

    for dk in ("CompositeExplicitAutograd",):
        lib.impl("flex_attention", fwd, dk)
        lib.impl("flex_attention_backward", bwd, dk)
    torch.library.register_fake("neuron::flex_attention", fwd_fake, lib=lib)
    torch.library.register_fake("neuron::flex_attention_backward", bwd_fake, lib=lib)

    def setup_context(ctx, inputs, output):
        (q, k, v, kv_num, kv_idx, full_num, full_idx, score_bufs, mask_bufs, ints, slots, key,
         scale, q_block, kv_block) = inputs
        ctx.save_for_backward(q, k, v, kv_num, kv_idx,
                              *(t for t in (full_num, full_idx) if t is not None),
                              *score_bufs, *mask_bufs)
        ctx.meta = (full_num is not None, len(score_bufs), len(mask_bufs), list(ints),
                    list(slots), key, scale, q_block, kv_block)

    def backward(ctx, grad_out, grad_lse, _grad_max):
        has_full, n_s, n_m, ints, slots, key, scale, q_block, kv_block = ctx.meta
        saved = list(ctx.saved_tensors)
        q, k, v, kv_num, kv_idx = saved[:5]
        rest = saved[5:]
        full_num, full_idx = (rest[0], rest[1]) if has_full else (None, None)
        rest = rest[2:] if has_full else rest
        score_bufs, mask_bufs = rest[:n_s], rest[n_s:n_s + n_m]
        dq, dk, dv, dbufs = torch.ops.neuron.flex_attention_backward(
            q, k, v, grad_out.contiguous(), grad_lse, kv_num, kv_idx, full_num, full_idx,
            score_bufs, mask_bufs, ints, slots, key, scale, q_block, kv_block)
        # Same structure as the inputs: list arguments get lists of gradients.
        return (dq, dk, dv, None, None, None, None, list(dbufs), [None] * n_m,
                [None] * len(ints), [None] * len(slots), None, None, None, None)

    torch.library.register_autograd("neuron::flex_attention", backward,
                                    setup_context=setup_context, lib=lib)
    _lib = lib


def _fx_int(node) -> bool:
    if isinstance(node, torch.fx.Node):   # Dynamo's graphs keep "example_value"
        val = node.meta.get("val", node.meta.get("example_value"))
    else:
        val = node
    return isinstance(val, (int, torch.SymInt))


def _ir_int(value) -> bool:
    import sympy
    return isinstance(value, (int, sympy.Expr))


def rewrite(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace ``higher_order.flex_attention`` nodes of a Dynamo graph by neuron ops."""
    hop = torch.ops.higher_order.flex_attention
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]
    if not nodes:
        return gm
    _define_ops()
    for node in nodes:
        (q, k, v, score_node, block_mask, scale, kernel_options, score_bufs,
         mask_bufs) = node.args[:9]
        (_, _, kv_num, kv_idx, full_num, full_idx, *_rest) = block_mask
        q_block, kv_block, mask_node = block_mask[-3], block_mask[-2], block_mask[-1]
        score_mod = getattr(gm, score_node.target) if score_node is not None else None
        mask_mod = getattr(gm, mask_node.target)
        key = _register_fns(score_mod, mask_mod)
        s_t, m_t, ints, slots = _split(score_bufs, mask_bufs, _fx_int)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.neuron.flex_attention.default,
                (q, k, v, kv_num, kv_idx, full_num, full_idx, s_t, m_t, ints, slots, key,
                 float(scale), int(q_block), int(kv_block)))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    # No dead-code pass here: it would drop the vmap nesting calls of a block mask built in
    # the graph (flex_attention without block_mask) and strand their batched tensors;
    # AOTAutograd drops what is dead itself.
    gm.recompile()
    return gm


def allow_neuron_device() -> None:
    """Let ``flex_attention`` accept neuron tensors (PyTorch lists the devices it knows)."""
    import torch.nn.attention.flex_attention as fa
    inner = fa._validate_device
    if getattr(inner, "_neuron", False):
        return

    def _validate_device(query, key, value):
        if query.device.type == "neuron":
            return
        return inner(query, key, value)

    _validate_device._neuron = True
    fa._validate_device = _validate_device


def install_inductor_lowerings() -> None:
    """Lower the flex_attention HOPs on neuron to the neuron ops under the default Inductor
    backend too (``torch.compile(flex_attention)``, as TorchTitan writes it). Inductor's own
    lowering keys on ``device.type == "cpu"`` and sends every other device to its Triton
    templates; the ``neuron`` backend rewrites the Dynamo graph instead (``rewrite``)."""
    from torch._inductor import lowering as L

    fwd_hop = torch.ops.higher_order.flex_attention
    bwd_hop = torch.ops.higher_order.flex_attention_backward
    inner_fwd, inner_bwd = L.lowerings[fwd_hop], L.lowerings[bwd_hop]
    if getattr(inner_fwd, "_neuron", False):
        return
    _define_ops()  # now, so that compiled code loaded from Inductor's cache finds the ops

    def _key(score_graph, block_mask):
        # By value (the pickled FX graphs), not by a hash of this process's registry: on a
        # cache hit Inductor skips lowering, and the compiled code must still find them.
        fns = (score_graph.graph_module if score_graph is not None else None,
               block_mask[-1].graph_module)
        key = "fx:" + base64.b64encode(zlib.compress(pickle.dumps(fns))).decode()
        _FN_REGISTRY[key] = fns
        return key

    def fwd(query, key, value, subgraph, block_mask, scale, kernel_options,
            score_mod_other_buffers, mask_mod_other_buffers):
        if query.get_device().type != "neuron":
            return inner_fwd(query, key, value, subgraph, block_mask, scale, kernel_options,
                             score_mod_other_buffers, mask_mod_other_buffers)
        kv_num, kv_idx, full_num, full_idx = block_mask[2:6]
        s_t, m_t, ints, slots = _split(score_mod_other_buffers, mask_mod_other_buffers, _ir_int)
        return L.fallback_handler(torch.ops.neuron.flex_attention.default, add_to_fallback_set=False)(
            query, key, value, kv_num, kv_idx, full_num, full_idx, s_t, m_t, ints, slots,
            _key(subgraph, block_mask), float(scale), int(block_mask[-3]), int(block_mask[-2]))

    def bwd(*args, **kwargs):
        (query, key, value, _out, _lse, grad_out, grad_logsumexp, fw_graph, _joint_graph,
         block_mask, scale, _kernel_options, score_mod_other_buffers,
         mask_mod_other_buffers) = args
        if query.get_device().type != "neuron":
            return inner_bwd(*args, **kwargs)
        kv_num, kv_idx, full_num, full_idx = block_mask[2:6]
        s_t, m_t, ints, slots = _split(score_mod_other_buffers, mask_mod_other_buffers, _ir_int)
        dq, dk, dv, dbufs = L.fallback_handler(
            torch.ops.neuron.flex_attention_backward.default, add_to_fallback_set=False)(
            query, key, value, grad_out, grad_logsumexp, kv_num, kv_idx, full_num, full_idx,
            s_t, m_t, ints, slots, _key(fw_graph, block_mask), float(scale),
            int(block_mask[-3]), int(block_mask[-2]))
        it = iter(dbufs)   # one gradient per captured value of score_mod: None for integers
        return dq, dk, dv, tuple(None if _ir_int(b) else next(it) for b in score_mod_other_buffers)

    fwd._neuron = bwd._neuron = True
    L.lowerings[fwd_hop] = fwd
    L.lowerings[bwd_hop] = bwd
