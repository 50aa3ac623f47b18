"""Mixture-of-experts MLP for context encoding (prefill): AWS's ``moe_cte``, block sharding.

Tokens arrive routed into blocks: ``token_position_to_id`` [N*B] lists, for each of N blocks
of B = ``block_size`` slots, the token in every slot (T, the padding id, names the padding
row ``hidden_states[T]``), and ``block_to_expert`` [N, 1] the expert of each block. For every
block the kernel gathers its tokens, computes ``act(h @ Wg) * (h @ Wu) @ Wd`` with that
expert's weights, scales each row by the token's affinity for the expert (POST_SCALE) and
adds it into the token's output row; a token routed to k experts sits in k blocks. Layouts
are AWS's: hidden_states [T+1, H], expert_affinities_masked [(T+1)*E, 1], gate_up_proj_weight
[E, H, 2, I], down_proj_weight [E, I, H]; the output is [T+1, H] in the inputs' dtype.

Implemented: the unquantized float32/bfloat16 path on one NeuronCore, optional biases
(gate_and_up_proj_bias [E, 2, I], down_proj_bias [E, H]), gate/up clamps, ``conditions``
(processing stops at the first block whose condition is 0), POST_SCALE and NO_SCALE, and
``is_tensor_update_accumulating=False`` (top-1: rows are written, not added). Matmuls run in
the inputs' dtype with fp32 PSUM accumulation (``compute_dtype`` is accepted and not used).
Quantization, MX, activation checkpointing, DMA skipping, PRE_SCALE and the shard-on-I
variants raise ``UnsupportedError``. Ours, beyond AWS's constraints: H a multiple of 128,
any I, block_size a multiple of 128.

Slots holding the padding id T are dropped: the padding row of the output stays zero. Rows
move by indirect DMA (software DGE), 128 token slots per DMA: the hidden rows and the
affinities gathered by the slots' token ids, the output rows scattered (added) back;
TensorE transposes the gathered rows into the K-on-partitions layout it contracts over,
hidden index h = p * (H / 128) + k on partition p, chunk k, the order in which the weights'
rows are contiguous per partition, a PSUM bank of transposes per copy out. The next block's
gather is issued before this block's matmuls, and the weights stream up to two chunks ahead
across blocks (``_WeightStream``), so the DMA queues fill them while TensorE works.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ...utils.common_types import ActFnType, ExpertAffinityScaleMode
from ...utils.refuse import refuse_given, unsupported
from ..expert_act import act_fn, combine

_BANK_F32 = 512          # fp32 values per partition in one 2 KiB PSUM bank
_BANK_BYTES = 2048
_AHEAD = 2               # weight chunks in flight beyond the one in use, at most ...
_WEIGHT_SBUF = 96 * 1024  # ... while every chunk in SBUF fits in this many bytes per partition
_I_CHUNK = 512           # columns of the gate and of the up projection loaded per DMA


class MoECTEImplementation(Enum):
    shard_on_block = 0
    shard_on_i = 1
    shard_on_i_hybrid = 2
    shard_on_i_dropping = 3
    shard_on_block_mx = 4
    shard_on_i_mx = 5
    shard_on_i_mx_hybrid = 6


@dataclass
class ShardOnBlockConfig(nl.NKIObject):
    """Accepted for compatibility; one core processes every block in order."""
    n_block_per_iter: int = 1
    block_sharding_strategy: Optional[object] = None
    n_static_blocks: int = -1
    n_dynamic_blocks: int = 55


@dataclass
class MoECTESpec(nl.NKIObject):
    """Which variant to run; only ``shard_on_block`` is implemented."""
    implementation: MoECTEImplementation = MoECTEImplementation.shard_on_block
    shard_on_block: Optional[ShardOnBlockConfig] = None
    shard_on_I: Optional[object] = None


def _bad_shape(msg):
    raise E.ShapeMismatchError(f"moe_cte: {msg}")


@nki.jit
def moe_cte(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
            token_position_to_id, block_to_expert, block_size, spec=None, conditions=None,
            gate_and_up_proj_bias=None, down_proj_bias=None, quantization_config=None,
            gate_up_proj_scale=None, down_proj_scale=None, gate_up_activations_T=None,
            down_activations=None, activation_function=ActFnType.SiLU, skip_dma=None,
            compute_dtype=None, is_tensor_update_accumulating=True,
            expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
            gate_clamp_upper_limit=None, gate_clamp_lower_limit=None,
            up_clamp_upper_limit=None, up_clamp_lower_limit=None, gate_up_in_scale=None,
            down_in_scale=None, accumulation_dtype=None, skip_gate_proj=False):
    if spec is not None and getattr(spec.implementation, "name", "") != "shard_on_block":
        unsupported("moe_cte", f"implementation {spec.implementation}")
    refuse_given("moe_cte", (
        ("quantization (quantization_config)", quantization_config),
        ("quantization (gate_up_proj_scale)", gate_up_proj_scale),
        ("quantization (down_proj_scale)", down_proj_scale),
        ("MX input scales (gate_up_in_scale)", gate_up_in_scale),
        ("MX input scales (down_in_scale)", down_in_scale),
        ("activation checkpointing (gate_up_activations_T)", gate_up_activations_T),
        ("activation checkpointing (down_activations)", down_activations)))
    if skip_gate_proj:
        unsupported("moe_cte", "skip_gate_proj")
    if skip_dma is not None and (getattr(skip_dma, "skip_token", False)
                                 or getattr(skip_dma, "skip_weight", False)):
        unsupported("moe_cte", "DMA skipping (skip_dma)")
    mode = getattr(expert_affinities_scaling_mode, "name", str(expert_affinities_scaling_mode))
    if mode not in ("POST_SCALE", "NO_SCALE"):
        unsupported("moe_cte", f"expert_affinities_scaling_mode {mode}")
    act = act_fn(activation_function)
    if act is None:
        unsupported("moe_cte", f"activation_function {activation_function}")
    if nl.num_programs(0) > 1:
        unsupported("moe_cte", "running on more than one NeuronCore (an LNC=2 grid)")

    P = nl.tile_size.pmax
    T1, H = hidden_states.shape
    if gate_up_proj_weight.ndim != 4 or gate_up_proj_weight.shape[1:3] != (H, 2):
        _bad_shape(f"gate_up_proj_weight {tuple(gate_up_proj_weight.shape)} must be [E, {H}, 2, I] "
                   f"for hidden_states {tuple(hidden_states.shape)}")
    n_exp, I = gate_up_proj_weight.shape[0], gate_up_proj_weight.shape[3]
    if tuple(down_proj_weight.shape) != (n_exp, I, H):
        _bad_shape(f"down_proj_weight {tuple(down_proj_weight.shape)} must be [{n_exp}, {I}, {H}]")
    if tuple(expert_affinities_masked.shape) != (T1 * n_exp, 1):
        _bad_shape(f"expert_affinities_masked {tuple(expert_affinities_masked.shape)} must be "
                   f"[{T1 * n_exp}, 1] ((T+1) * E)")
    B = int(block_size)
    if B <= 0 or B % P:
        _bad_shape(f"block_size {B} must be a positive multiple of {P}")
    if H % P:
        _bad_shape(f"hidden size H={H} must be a multiple of {P}")
    NB = block_to_expert.shape[0]
    if token_position_to_id.ndim != 1 or token_position_to_id.shape[0] != NB * B:
        _bad_shape(f"token_position_to_id {tuple(token_position_to_id.shape)} must be [N*B] = "
                   f"[{NB * B}] for block_to_expert {tuple(block_to_expert.shape)} and block_size {B}")
    dt = hidden_states.dtype
    for nm, t in (("gate_up_proj_weight", gate_up_proj_weight), ("down_proj_weight", down_proj_weight)):
        if t.dtype != dt or dt not in (nl.float32, nl.bfloat16):
            raise E.DtypeLegalityError(f"moe_cte: hidden_states and {nm} must share dtype float32 or "
                                       f"bfloat16, got {dt.name} and {t.dtype.name}")
    for nm, t in (("token_position_to_id", token_position_to_id), ("block_to_expert", block_to_expert)):
        if t.dtype != nl.int32:
            raise E.DtypeLegalityError(f"moe_cte: {nm} must be int32, got {t.dtype.name}")

    out = nl.ndarray((T1, H), dtype=dt, buffer=nl.shared_hbm)
    c = _Cfg(h=hidden_states, aff=expert_affinities_masked.reshape((T1, n_exp)),
             wgu=gate_up_proj_weight, wd=down_proj_weight, out=out, dt=dt, T1=T1, H=H, I=I,
             E=n_exp, B=B, kh=H // P, ni=(I + P - 1) // P, act=act,
             scale=mode == "POST_SCALE", accumulate=bool(is_tensor_update_accumulating),
             bgu=gate_and_up_proj_bias, bd=down_proj_bias,
             gclamp=(gate_clamp_lower_limit, gate_clamp_upper_limit),
             uclamp=(up_clamp_lower_limit, up_clamp_upper_limit), reg=nisa.register_alloc(0))
    _zero(c)
    blocks = _blocks(c, block_to_expert, conditions, NB)
    # PSUM rings (gate, up, down results), each slot a whole bank, used in turn
    c.g_ring = nl.ndarray((P, 2, _BANK_F32), dtype=nl.float32, buffer=nl.psum)
    c.u_ring = nl.ndarray((P, 2, _BANK_F32), dtype=nl.float32, buffer=nl.psum)
    c.y_ring = nl.ndarray((P, 2, _BANK_F32), dtype=nl.float32, buffer=nl.psum)
    # transposes land a bank's worth at a time (8 in bf16, 4 in fp32), one copy out per bank
    c.t_group = min(c.kh, _BANK_BYTES // (P * dt.itemsize))
    c.t_ring = nl.ndarray((P, 2, c.t_group * P), dtype=c.dt, buffer=nl.psum)
    c.n_gu = c.n_y = c.n_t = 0
    c.pos = token_position_to_id
    c.weights = _WeightStream(c, blocks)
    gathered = [_gather(c, *blocks[0])] if blocks else []
    for i, (n, e) in enumerate(blocks):
        if i + 1 < len(blocks):
            gathered.append(_gather(c, *blocks[i + 1]))
        g = gathered[i]
        gathered[i] = None
        actT = _gate_up(c, e, g)
        y = _down(c, e, g, actT)
        _scatter(c, g, y)
    return out


class _WeightStream:
    """Every block's weight chunks in the order the matmuls take them (gate/up chunks of
    _I_CHUNK columns, then down chunks of a PSUM bank's width), loaded up to two chunks ahead
    (as SBUF allows): the next chunks, of this block or the next, stream in while this one's
    matmuls run."""

    def __init__(self, c, blocks):
        P = nl.tile_size.pmax
        self.loads = []
        for _, e in blocks:
            w_e = c.wgu[e].reshape((P, c.kh, 2, c.I))   # row p * kh + k on partition p, chunk k
            for i0 in range(0, c.I, _I_CHUNK):
                self.loads.append(lambda w_e=w_e, i0=i0: _load_gate_up(c, w_e, i0))
            for h0 in range(0, c.H, _BANK_F32):
                self.loads.append(lambda e=e, h0=h0: _load_down(c, e, h0))
        self.next = 0
        item = c.dt.itemsize
        chunk = item * max(c.kh * 2 * min(_I_CHUNK, c.I), c.ni * min(_BANK_F32, c.H))
        ahead = max(0, min(_AHEAD, _WEIGHT_SBUF // chunk - 1))
        self.ahead = [self._load() for _ in range(ahead)]

    def _load(self):
        if self.next == len(self.loads):
            return None
        self.next += 1
        return self.loads[self.next - 1]()

    def take(self):
        if not self.ahead:
            return self._load()
        cur = self.ahead.pop(0)
        self.ahead.append(self._load())
        return cur


def _load_gate_up(c, w_e, i0):
    w = nl.ndarray((nl.tile_size.pmax, c.kh, 2, min(_I_CHUNK, c.I - i0)), dtype=c.dt,
                   buffer=nl.sbuf)
    nisa.dma_copy(dst=w, src=w_e[:, :, :, i0:i0 + w.shape[3]])
    return w


def _load_down(c, e, h0):
    P = nl.tile_size.pmax
    wd = nl.ndarray((P, c.ni, min(_BANK_F32, c.H - h0)), dtype=c.dt, buffer=nl.sbuf)
    for ci in range(c.ni):
        iw = min(P, c.I - ci * P)
        nisa.dma_copy(dst=wd[0:iw, ci, :], src=c.wd[e, ci * P:ci * P + iw, h0:h0 + wd.shape[2]])
    return wd


def _zero(c):
    """The output starts at zero: tokens in no block (and the padding row) stay there."""
    P = nl.tile_size.pmax
    z = nl.ndarray((P, c.H), dtype=c.dt, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0, engine=nisa.gpsimd_engine)
    for r0 in range(0, c.T1, P):
        r = min(P, c.T1 - r0)
        nisa.dma_copy(dst=c.out[r0:r0 + r, :], src=z[0:r, :])


def _blocks(c, block_to_expert, conditions, NB):
    """(block, expert) pairs to process: the experts through a register; blocks of an expert
    id outside [0, E) are skipped, and processing stops at a zero condition."""
    bte = nl.ndarray((1, NB), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=bte, src=block_to_expert.reshape((1, NB)))
    cond = None
    if conditions is not None:
        if conditions.shape[0] < NB:
            _bad_shape(f"conditions {tuple(conditions.shape)} must hold at least N={NB} entries")
        cond = nl.ndarray((1, NB), dtype=conditions.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=cond, src=conditions.reshape((conditions.shape[0],))[0:NB].reshape((1, NB)))
    out = []
    for n in range(NB):
        if cond is not None:
            nisa.register_load(c.reg, cond[0:1, n:n + 1])
            if int(c.reg) == 0:
                break
        nisa.register_load(c.reg, bte[0:1, n:n + 1])
        e = int(c.reg)
        if 0 <= e < c.E:
            out.append((n, e))
    return out


class _Block:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _gather(c, n, e):
    """The block's token rows gathered by indirect DMA, 128 slots per DMA, into h [128, B/128,
    H] (slot j*128 + p on partition p), then TensorE transposes into hT [128, H/128, B] (K on
    partitions, hidden index p*(H/128) + k at [p, k, :]), a PSUM bank of transposes per
    copy; and the slots' affinities for expert e into aff [128, B/128], gathered the same
    way. The slots' token ids land one per partition in ids [128, B/128]; an id outside
    hidden_states' rows is the DMA's out-of-bounds error. Padding slots read the padding row
    and are dropped at the scatter."""
    P = nl.tile_size.pmax
    B, H = c.B, c.H
    nt = B // P
    hT = nl.ndarray((P, c.kh, B), dtype=c.dt, buffer=nl.sbuf)
    h = nl.ndarray((P, nt, H), dtype=c.dt, buffer=nl.sbuf)
    aff = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    ids = nl.ndarray((P, nt), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids, src=c.pos[n * B:(n + 1) * B].reshape((nt, P)).ap(
        [[1, P], [P, nt]]))
    for j in range(nt):
        nisa.dma_copy(dst=h[:, j, :], src=c.h.ap([[H, P], [1, H]], vector_offset=ids[:, j:j + 1]),
                      dge_mode=nisa.dge_mode.swdge)
        if c.scale:
            nisa.dma_copy(dst=aff[:, j:j + 1],
                          src=c.aff.ap([[c.E, P], [1, 1]], offset=e, vector_offset=ids[:, j:j + 1]),
                          dge_mode=nisa.dge_mode.swdge)
    G = c.t_group
    for j in range(nt):
        for k0 in range(0, c.kh, G):
            g = min(G, c.kh - k0)
            slot = c.n_t % 2
            c.n_t += 1
            tp = c.t_ring[:, slot, 0:g * P]
            for k in range(g):
                nisa.nc_transpose(dst=tp[:, k * P:(k + 1) * P], data=h[:, j, k0 + k::c.kh])
            dst = hT[:, k0:k0 + g, j * P:(j + 1) * P]
            src = tp.reshape((P, g, P))
            if slot:
                nisa.activation(dst=dst, op=nl.copy, data=src)
            else:
                nisa.tensor_copy(dst=dst, src=src)
    return _Block(n=n, e=e, hT=hT, aff=aff, ids=ids)


def _gate_up(c, e, g):
    """actT [128, ceil(I/128), B] = act(h @ Wg (+ bg)) * (h @ Wu (+ bu)), I on partitions:
    the stationary operand of the down projection."""
    P = nl.tile_size.pmax
    B, I = c.B, c.I
    actT = nl.ndarray((P, c.ni, B), dtype=c.dt, buffer=nl.sbuf)
    bias = None
    if c.bgu is not None:       # per-I biases, I on partitions: [128, ni, 2]
        bias = nl.ndarray((P, c.ni, 2), dtype=nl.float32, buffer=nl.sbuf)
        for ci in range(c.ni):
            iw = min(P, I - ci * P)
            for j in range(2):
                nisa.dma_copy(dst=bias[0:iw, ci, j:j + 1],
                              src=c.bgu[e, j, ci * P:ci * P + iw].reshape((iw, 1)))
    for i0 in range(0, I, _I_CHUNK):
        icw = min(_I_CHUNK, I - i0)
        w = c.weights.take()
        for s0 in range(0, icw, P):
            iw, ci = min(P, icw - s0), (i0 + s0) // P
            for b0 in range(0, B, _BANK_F32):
                bw = min(_BANK_F32, B - b0)
                slot = c.n_gu % 2
                c.n_gu += 1
                gp = c.g_ring[0:iw, slot, 0:bw]
                up = c.u_ring[0:iw, slot, 0:bw]
                for k in range(c.kh):
                    nisa.nc_matmul(dst=gp, stationary=w[:, k, 0, s0:s0 + iw],
                                   moving=g.hT[:, k, b0:b0 + bw], accumulate=k > 0)
                for k in range(c.kh):
                    nisa.nc_matmul(dst=up, stationary=w[:, k, 1, s0:s0 + iw],
                                   moving=g.hT[:, k, b0:b0 + bw], accumulate=k > 0)
                combine(c, gp, up, actT[0:iw, ci, b0:b0 + bw],
                         None if bias is None else bias[0:iw, ci, :])
    return actT


def _down(c, e, g, actT):
    """y [128, B/128, H] = actT.T @ Wd (+ bd), token slot j*128 + p on partition p, scaled
    by the slot's affinity as it leaves PSUM (VectorE and ScalarE in turn)."""
    P = nl.tile_size.pmax
    B, H, I = c.B, c.H, c.I
    nt = B // P
    y = nl.ndarray((P, nt, H), dtype=c.dt, buffer=nl.sbuf)
    for h0 in range(0, H, _BANK_F32):
        hw = min(_BANK_F32, H - h0)
        wd = c.weights.take()
        bd = None
        if c.bd is not None:     # the bias row on every partition
            bd = nl.ndarray((P, hw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=bd, src=c.bd[e:e + 1, h0:h0 + hw].ap([[0, P], [1, hw]]))
        for j in range(nt):
            slot = c.n_y % 2
            c.n_y += 1
            yp = c.y_ring[:, slot, 0:hw]
            for ci in range(c.ni):
                iw = min(P, I - ci * P)
                nisa.nc_matmul(dst=yp, stationary=actT[0:iw, ci, j * P:(j + 1) * P],
                               moving=wd[0:iw, ci, :], accumulate=ci > 0)
            dst = y[:, j, h0:h0 + hw]
            src = yp
            if bd is not None:
                t = nl.ndarray((P, hw), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=t, data1=yp, data2=bd, op=nl.add)
                src = t
            if not c.scale:
                nisa.tensor_copy(dst=dst, src=src)
            elif slot:
                nisa.activation(dst=dst, op=nl.copy, data=src, scale=g.aff[:, j:j + 1])
            else:
                nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=g.aff[:, j:j + 1])
    return y


def _scatter(c, g, y):
    """Each slot's row into its token's output row by indirect DMA, 128 slots per DMA: added
    (top-k) or written (top-1). The padding id is moved out of range first (VectorE), so the
    DMA skips those slots and the padding row of the output stays zero."""
    P = nl.tile_size.pmax
    nt = c.B // P
    rmw = nl.add if c.accumulate else None
    far = nl.ndarray((P, nt), dtype=nl.int32, buffer=nl.sbuf)
    # id + (id == T) * 2^23: exact in the float32 VectorE computes in, past the output's rows
    nisa.tensor_scalar(dst=far, data=g.ids, op0=nl.equal, operand0=c.T1 - 1,
                       op1=nl.multiply, operand1=float(1 << 23))
    nisa.tensor_tensor(dst=far, data1=far, data2=g.ids, op=nl.add)
    for j in range(nt):
        nisa.dma_copy(dst=c.out.ap([[c.H, P], [1, c.H]], vector_offset=far[:, j:j + 1]),
                      src=y[:, j, :], dst_rmw_op=rmw, oob_mode=nisa.oob_mode.skip,
                      dge_mode=nisa.dge_mode.swdge)
