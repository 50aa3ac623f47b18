"""Mixture-of-experts MLP for token generation (decode): AWS's ``moe_tkg``.

out[t] = sum over the experts e a token uses of  w[t, e] * (act(x Wg + bg) * (x Wu + bu)) Wd + bd,
for up to 128 tokens at once. Layouts are AWS's: hidden_input [T, H], expert_gate_up_weights
[E_L, H, 2, I], expert_down_weights [E_L, I, H], expert_affinities [T, E], expert_index
[T, K]; biases [E_L, 2, I] and [E_L, H]; the output is [T, H].

Two modes, as AWS's:
* **selective** (``is_all_expert=False``): only the experts some token picked in
  ``expert_index`` run. Their set is found on chip: a one-hot of each token's picks (VectorE,
  against an iota of expert ids), its column sums by one matmul, each sum read into a
  register. The weights of an expert load once for all the tokens that picked it (AWS's
  kernel loads them per token and pick), and every token goes through that expert's matmuls
  with weight 0 where it did not pick it: at T <= 128 the tokens are TensorE's moving free
  dimension, so they cost the same as one. w[t, e] is the affinity expert_affinities[t, e]
  times how often t picked e (POST_SCALE), those counts alone (NO_SCALE), or, with
  ``expert_affinities_eager`` [T, K], the eager affinity of each pick. Expert ids outside
  [0, E_L) pick nothing. Because the set is data, everything after it waits for the router's
  result (the simulator holds later instructions until a loaded register's value is known).
* **all-expert** (``is_all_expert=True``): every local expert runs, a static loop whose weight
  DMAs need nothing computed. Local expert e is global expert E_L * rank_id + e; POST_SCALE
  scales by that affinity column, zeroed where the token did not pick the expert when
  ``mask_unselected_experts``; NO_SCALE adds every expert's output unscaled.

Matmuls run in the weights' dtype with fp32 PSUM accumulation; the experts' outputs add in
fp32 in SBUF and are rounded once to ``output_dtype``. Gate/up weights stream in chunks of I
(up to 24 KiB per partition; H too where SBUF is short), the down weights in blocks of up to
16 KiB, through SBUF rings four deep, so the DMA queues run ahead of TensorE. Hidden index p * (H / 128) + k sits on partition p,
chunk k, where the weights' rows are contiguous per partition.

Implemented: bf16/fp16/fp32 inputs (hidden and weights one dtype), T <= 128, H a multiple of
128, any I, biases, gate/up clamps, SiLU/GELU/GELU-tanh/Swish. Under an LNC grid
(``moe_tkg[2]``) the first core does all the work and the others idle: the result is right,
the modelled time one core's. Quantized weights (FP8 row/static, MX), a hidden input or
output in SBUF and PRE_SCALE modes raise ``UnsupportedError``; ``is_all_expert_dynamic`` is accepted (the static loop gives the
same result).
"""
from __future__ import annotations

from types import SimpleNamespace as _Cfg

import nki
import nki.isa as nisa
import nki.language as nl
from nki import errors as E

from ...utils.common_types import ActFnType, ExpertAffinityScaleMode
from ...utils.dma import runs as _runs
from ...utils.refuse import refuse_given, unsupported
from ..expert_act import act_fn, combine

_P = 128
_BANK = 512                 # fp32 values per partition in one PSUM bank
_W_BYTES = 24 * 1024        # per partition: one gate/up weight chunk, at most
_D_BYTES = 16 * 1024        # per partition: one down-projection weight block, at most
_SLOTS = 4
_W_SLOTS = 4
_OUT_COLS = 2048            # output columns rounded and stored per step


def _bad(msg):
    raise E.ShapeMismatchError(f"moe_tkg: {msg}")


@nki.jit
def moe_tkg(hidden_input, expert_gate_up_weights, expert_down_weights, expert_affinities,
            expert_index, is_all_expert, rank_id=None, expert_gate_up_bias=None,
            expert_down_bias=None, expert_gate_up_weights_scale=None,
            expert_down_weights_scale=None, hidden_input_scale=None, gate_up_input_scale=None,
            down_input_scale=None, mask_unselected_experts=False, expert_affinities_eager=None,
            expert_affinities_scaling_mode=ExpertAffinityScaleMode.NO_SCALE,
            activation_fn=ActFnType.SiLU, output_dtype=None, gate_clamp_upper_limit=None,
            gate_clamp_lower_limit=None, up_clamp_upper_limit=None, up_clamp_lower_limit=None,
            output_in_sbuf=False, is_all_expert_dynamic=False):
    refuse_given("moe_tkg", (
        ("quantized weights (expert_gate_up_weights_scale)", expert_gate_up_weights_scale),
        ("quantized weights (expert_down_weights_scale)", expert_down_weights_scale),
        ("MX input (hidden_input_scale)", hidden_input_scale),
        ("static quantization (gate_up_input_scale)", gate_up_input_scale),
        ("static quantization (down_input_scale)", down_input_scale)))
    if output_in_sbuf:
        unsupported("moe_tkg", "output_in_sbuf")
    if hidden_input.kind != "hbm":
        unsupported("moe_tkg", "a hidden_input in SBUF")
    if is_all_expert_dynamic and not is_all_expert:
        raise E.NkiRuleError("moe_tkg: is_all_expert_dynamic is only valid with is_all_expert=True")
    if hidden_input.ndim != 2:
        _bad(f"hidden_input {tuple(hidden_input.shape)} must be [T, H]")
    T, H = hidden_input.shape
    c = config(hidden_input.dtype, T, H, expert_gate_up_weights, expert_down_weights,
               expert_gate_up_bias, expert_down_bias, expert_affinities_scaling_mode,
               activation_fn, (gate_clamp_lower_limit, gate_clamp_upper_limit),
               (up_clamp_lower_limit, up_clamp_upper_limit))
    Ea = expert_affinities.shape[-1]
    if tuple(expert_affinities.shape) != (T, Ea):
        _bad(f"expert_affinities {tuple(expert_affinities.shape)} must be [T={T}, E]")
    if expert_index.ndim != 2 or expert_index.shape[0] != T:
        _bad(f"expert_index {tuple(expert_index.shape)} must be [T={T}, K]")
    K = expert_index.shape[1]
    if expert_index.dtype.is_float:
        raise E.DtypeLegalityError(f"moe_tkg: expert_index must be an integer tensor, got "
                                   f"{expert_index.dtype.name}")
    if expert_affinities_eager is not None and tuple(expert_affinities_eager.shape) != (T, K):
        _bad(f"expert_affinities_eager {tuple(expert_affinities_eager.shape)} must be [T, K] = "
             f"[{T}, {K}]")
    out_dt = hidden_input.dtype if output_dtype is None else nl.as_dtype(output_dtype)
    out = nl.ndarray((T, H), dtype=out_dt, buffer=nl.shared_hbm)
    if nl.program_id(0) > 0:    # an LNC grid: the first core computes, the others idle
        return out

    base = 0
    if is_all_expert:
        if rank_id is not None:
            rk = nl.ndarray((1, 1), dtype=rank_id.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=rk, src=rank_id.reshape((1, 1)))
            reg = nisa.register_alloc(0)
            nisa.register_load(reg, rk)
            base = c.E * int(reg)
        elif c.scale:
            raise E.NkiRuleError("moe_tkg: rank_id is required for all-expert mode with affinity "
                                 "scaling")
        if c.scale and base + c.E > Ea:
            _bad(f"rank_id {base // c.E} selects experts [{base}, {base + c.E}) of "
                 f"expert_affinities' {Ea}")
    elif Ea < c.E and c.scale and expert_affinities_eager is None:
        _bad(f"expert_affinities {tuple(expert_affinities.shape)} has fewer columns than the "
             f"{c.E} experts")

    x = nl.ndarray((T, H), dtype=c.dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=hidden_input)
    need_sel = not is_all_expert or (c.scale and mask_unselected_experts)
    sel = None
    if need_sel:
        idx = nl.ndarray((T, K), dtype=expert_index.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=expert_index)
        sel = picks(c, idx, base, eager=expert_affinities_eager)
    wsel = None
    if c.scale and (expert_affinities_eager is None or is_all_expert):
        aff = nl.ndarray((T, c.E), dtype=expert_affinities.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=aff, src=expert_affinities[:, base:base + c.E])
        wsel = aff
        if sel is not None:
            wsel = nl.ndarray((T, c.E), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=wsel, data1=sel.count, data2=aff, op=nl.multiply)
    elif sel is not None:
        wsel = sel.eager if (c.scale and sel.eager is not None) else sel.count
    alloc_rings(c)
    experts = list(range(c.E)) if is_all_expert else used_experts(c, sel.count)
    xT = transpose_hidden(c, x)
    del x           # its SBUF goes back to the rings' neighbours
    acc = run_experts(c, xT, wsel, experts)
    store(acc, out)
    return out


def config(dt, T, H, wgu, wd, bgu, bd, scaling_mode, activation, gclamp, uclamp):
    """The expert stage's operands and options, shared with ``moe_block_tkg``."""
    if not 1 <= T <= _P:
        _bad(f"T={T} tokens; token generation takes 1 to {_P} (batch * sequence)")
    if H % _P:
        _bad(f"hidden size H={H} must be a multiple of {_P}")
    if wgu.ndim != 4 or tuple(wgu.shape[1:3]) != (H, 2):
        _bad(f"expert_gate_up_weights {tuple(wgu.shape)} must be [E_L, {H}, 2, I]")
    n_exp, I = wgu.shape[0], wgu.shape[3]
    if tuple(wd.shape) != (n_exp, I, H):
        _bad(f"expert_down_weights {tuple(wd.shape)} must be [{n_exp}, {I}, {H}]")
    if bgu is not None and tuple(bgu.shape) != (n_exp, 2, I):
        _bad(f"expert_gate_up_bias {tuple(bgu.shape)} must be [{n_exp}, 2, {I}]")
    if bd is not None and tuple(bd.shape) != (n_exp, H):
        _bad(f"expert_down_bias {tuple(bd.shape)} must be [{n_exp}, {H}]")
    wdt = wgu.dtype
    if wdt not in (nl.float32, nl.bfloat16, nl.float16) or wd.dtype != wdt or dt != wdt:
        raise E.DtypeLegalityError(
            f"moe_tkg: hidden_input and the expert weights must share dtype float32, bfloat16 or "
            f"float16; got {dt.name}, {wdt.name} and {wd.dtype.name} (quantized weights are not "
            f"implemented)")
    mode = getattr(scaling_mode, "name", str(scaling_mode))
    if mode not in ("POST_SCALE", "NO_SCALE"):
        unsupported("moe_tkg", f"expert_affinities_scaling_mode {mode}")
    act = act_fn(activation)
    if act is None:
        unsupported("moe_tkg", f"activation_fn {activation}")
    kh, ni = H // _P, -(-I // _P)
    isz = wdt.itemsize
    # The rings get what the stage's other tiles leave of each partition (the accumulator, x
    # and x^T, and a margin), four slots each: up to 24 KiB per weight chunk and 16 KiB per block.
    left = nl.tile_size.total_available_sbuf_size - H * (4 + isz) - 2 * kh * T * isz - 8192
    w_bytes = max(2 * _P * isz, min(_W_BYTES, left * 6 // 10 // _W_SLOTS))
    d_bytes = max(32 * ni * isz, min(_D_BYTES, left * 4 // 10 // _W_SLOTS))
    icw = max(_P, min(ni * _P, w_bytes // (kh * 2 * isz) // _P * _P))
    kc = min(kh, max(1, w_bytes // (2 * icw * isz)))
    hwd = d_bytes // (ni * isz)
    hwd = min(H, hwd // _BANK * _BANK if hwd >= _BANK else max(32, hwd // 32 * 32))
    c = _Cfg(dt=wdt, T=T, H=H, I=I, E=n_exp, kh=kh, ni=ni, icw=icw, kc=kc, hwd=hwd, act=act,
             scale=mode == "POST_SCALE", wgu=wgu, wd=wd, bgu=bgu, bd=bd, gclamp=gclamp,
             uclamp=uclamp)
    return c


def alloc_rings(c):
    """The expert stage's SBUF and PSUM rings; allocated once the caller's large temporaries
    are gone (at large H they would not fit together)."""
    T, I, kh, ni, icw, kc, hwd, wdt = c.T, c.I, c.kh, c.ni, c.icw, c.kc, c.hwd, c.dt
    # down-projection results [T, 512]: a bank each, 4 in turn (one expert's H/512 blocks
    # and the next's do not wait for VectorE to empty the bank before)
    c.y_ring = nl.ndarray((_P, _SLOTS, _BANK), dtype=nl.float32, buffer=nl.psum)
    # gate/up results [I-slice, T] in turn: 4 to 16 slots each (one bank), so TensorE runs
    # that many slices ahead of the activation's ScalarE -> VectorE chain
    c.gu_slots = max(_SLOTS, min(16, _BANK // T))
    c.g_ring = nl.ndarray((_P, c.gu_slots, T), dtype=nl.float32, buffer=nl.psum)
    c.u_ring = nl.ndarray((_P, c.gu_slots, T), dtype=nl.float32, buffer=nl.psum)
    # SBUF rings, allocated once (tiles allocated per use fragment SBUF over many experts):
    # four weight chunks and blocks in flight, so the DMA queues run ahead of TensorE;
    # two expert activations (this expert's and the next's, computed ahead)
    c.w_slots = _W_SLOTS
    c.w_ring = nl.ndarray((_P, _W_SLOTS, kc, 2, icw), dtype=wdt, buffer=nl.sbuf)
    c.d_ring = nl.ndarray((_P, _W_SLOTS, ni, hwd), dtype=wdt, buffer=nl.sbuf)
    c.a_ring = nl.ndarray((_P, 2, ni, T), dtype=wdt, buffer=nl.sbuf)
    c.b_ring = nl.ndarray((_P, 2, ni, 2), dtype=nl.float32, buffer=nl.sbuf) if c.bgu is not None else None
    c.bd_ring = nl.ndarray((T, 2, _BANK), dtype=nl.float32, buffer=nl.sbuf) if c.bd is not None else None
    c.n_w = c.n_d = c.n_a = c.n_bd = 0
    c.n_gu = c.n_y = 0


def transpose_hidden(c, x):
    """x [T, H] in SBUF -> xT [128, H/128, T] (hidden index p * H/128 + k at [p, k, :]) on
    TensorE: as many transposes as fill a PSUM bank, then one copy out of it (VectorE and
    ScalarE in turn), so the transposes do not wait on copies."""
    T, kh = c.T, c.kh
    xT = nl.ndarray((_P, kh, T), dtype=c.dt, buffer=nl.sbuf)
    per = max(1, min(kh, 2048 // (T * c.dt.itemsize)))
    ring = nl.ndarray((_P, 2, per, T), dtype=c.dt, buffer=nl.psum)
    for n, k0 in enumerate(range(0, kh, per)):
        nk = min(per, kh - k0)
        ps = ring[:, n % 2, 0:nk, :]
        for j in range(nk):
            nisa.nc_transpose(dst=ps[:, j, :], data=x[:, k0 + j::kh])
        if n % 2:
            nisa.activation(dst=xT[:, k0:k0 + nk, :], op=nl.copy, data=ps)
        else:
            nisa.tensor_copy(dst=xT[:, k0:k0 + nk, :], src=ps)
    return xT


def picks(c, idx, base, eager=None):
    """count [T, E_L]: how often each token picked each local expert (global id base + e),
    from its picks idx [T, K]; with ``eager`` [T, K] in HBM also the per-expert sums of the
    picks' eager affinities."""
    T, K = idx.shape
    f32 = nl.float32
    idf = nl.ndarray((T, K), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=idf, src=idx)
    ids = nl.ndarray((T, c.E), dtype=f32, buffer=nl.sbuf)
    nisa.iota(dst=ids, pattern=[[1, c.E]], offset=base)
    count = nl.ndarray((T, c.E), dtype=f32, buffer=nl.sbuf)
    ea = esum = None
    if eager is not None:
        ea = nl.ndarray((T, K), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ea, src=eager)
        esum = nl.ndarray((T, c.E), dtype=f32, buffer=nl.sbuf)
        one = nl.ndarray((T, c.E), dtype=f32, buffer=nl.sbuf)
    for k in range(K):
        if k == 0:
            nisa.tensor_scalar(dst=count, data=ids, op0=nl.equal, operand0=idf[:, 0:1])
        else:
            nisa.scalar_tensor_tensor(dst=count, data=ids, op0=nl.equal, operand0=idf[:, k:k + 1],
                                      op1=nl.add, operand1=count)
        if ea is not None:
            dst = esum if k == 0 else one
            nisa.tensor_scalar(dst=dst, data=ids, op0=nl.equal, operand0=idf[:, k:k + 1],
                               op1=nl.multiply, operand1=ea[:, k:k + 1])
            if k:
                nisa.tensor_tensor(dst=esum, data1=esum, data2=one, op=nl.add)
    return _Cfg(count=count, eager=esum)


def used_experts(c, count):
    """The experts some token picked: count's column sums (one matmul against a ones
    column), each read into a register."""
    T = c.T
    ones = nl.ndarray((T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0, engine=nisa.gpsimd_engine)
    sums = nl.ndarray((1, c.E), dtype=nl.float32, buffer=nl.sbuf)
    for e0 in range(0, c.E, _BANK):
        ew = min(_BANK, c.E - e0)
        ps = c.y_ring[0:1, c.n_y % _SLOTS, 0:ew]
        c.n_y += 1
        nisa.nc_matmul(dst=ps, stationary=ones, moving=count[:, e0:e0 + ew])
        nisa.tensor_copy(dst=sums[:, e0:e0 + ew], src=ps)
    reg = nisa.register_alloc(0)
    used = []
    for e in range(c.E):
        nisa.register_load(reg, sums[0:1, e:e + 1])
        if int(reg) > 0:
            used.append(e)
    return used


def run_experts(c, xT, wsel, experts):
    """acc [T, H] fp32 = sum over ``experts`` of wsel[:, e] * expert_e(x) (wsel None: weight
    1)."""
    acc = nl.ndarray((c.T, c.H), dtype=nl.float32, buffer=nl.sbuf)
    if not experts:
        nisa.memset(dst=acc, value=0.0, engine=nisa.gpsimd_engine)
    # One expert ahead: TensorE runs the next expert's gate/up matmuls while this one's
    # activation crosses ScalarE and VectorE (in program order it would wait for it).
    ahead = _gate_up(c, experts[0], xT) if experts else None
    for n, e in enumerate(experts):
        actT = ahead
        if n + 1 < len(experts):
            ahead = _gate_up(c, experts[n + 1], xT)
        _down(c, e, actT, None if wsel is None else wsel[:, e:e + 1], acc, first=n == 0)
    return acc


def store(acc, out):
    """acc [T, H] fp32 into out in HBM: directly, or rounded to out's dtype by column blocks
    (a [T, H] tile of its own would not fit SBUF beside the rings at large H)."""
    T, H = acc.shape
    if out.dtype == acc.dtype:
        nisa.dma_copy(dst=out, src=acc)
        return
    w = min(H, _OUT_COLS)
    ring = nl.ndarray((T, 2, w), dtype=out.dtype, buffer=nl.sbuf)
    for n, h0 in enumerate(range(0, H, w)):
        hw = min(w, H - h0)
        o = ring[:, n % 2, 0:hw]
        if n % 2:
            nisa.activation(dst=o, op=nl.copy, data=acc[:, h0:h0 + hw])
        else:
            nisa.tensor_copy(dst=o, src=acc[:, h0:h0 + hw])
        nisa.dma_copy(dst=out[:, h0:h0 + hw], src=o)


def _gate_up(c, e, xT):
    """actT [128, ceil(I/128), T] = act(x Wg + bg) * (x Wu + bu), I on partitions."""
    T, I, kh = c.T, c.I, c.kh
    actT = c.a_ring[:, c.n_a % 2]
    w_e = c.wgu[e].reshape((_P, kh, 2, I))      # row p * kh + k on partition p, chunk k
    bias = None
    if c.bgu is not None:
        bias = c.b_ring[:, c.n_a % 2]
        for ci in range(c.ni):
            iw = min(_P, I - ci * _P)
            for j in range(2):
                nisa.dma_copy(dst=bias[0:iw, ci, j:j + 1],
                              src=c.bgu[e, j, ci * _P:ci * _P + iw].reshape((iw, 1)))
    for i0 in range(0, I, c.icw):
        icw = min(c.icw, I - i0)
        slices = []
        for s0 in range(0, icw, _P):
            slot = c.n_gu % c.gu_slots
            c.n_gu += 1
            iw = min(_P, icw - s0)
            slices.append((s0, iw, c.g_ring[0:iw, slot, 0:T], c.u_ring[0:iw, slot, 0:T]))
        # The contraction in chunks of kc rows per partition where one chunk of all of H would
        # not fit its SBUF slot (large H in fp32); the products accumulate across chunks.
        for k0 in range(0, kh, c.kc):
            kc = min(c.kc, kh - k0)
            w = c.w_ring[:, c.n_w % c.w_slots, 0:kc, :, 0:icw]
            c.n_w += 1
            for g0, ng in _runs(kc):     # a DMA spreads over 4 of the 16 queues: use them all
                nisa.dma_copy(dst=w[:, g0:g0 + ng],
                              src=w_e[:, k0 + g0:k0 + g0 + ng, :, i0:i0 + icw])
            for s0, iw, gp, up in slices:
                for j, dst in ((0, gp), (1, up)):
                    for k in range(kc):
                        nisa.nc_matmul(dst=dst, stationary=w[:, k, j, s0:s0 + iw],
                                       moving=xT[:, k0 + k, :], accumulate=k0 + k > 0)
        for s0, iw, gp, up in slices:
            ci = (i0 + s0) // _P
            combine(c, gp, up, actT[0:iw, ci, :], None if bias is None else bias[0:iw, ci, :])
    c.n_a += 1
    return actT


def _down(c, e, actT, w, acc, first):
    """acc (+)= w * (actT.T Wd + bd): the weights in blocks of up to 16 KiB per partition
    (wide rows stream faster), the matmuls by 512 output columns (a PSUM bank)."""
    T, H, I = c.T, c.H, c.I
    for b0 in range(0, H, c.hwd):
        bw = min(c.hwd, H - b0)
        wd = c.d_ring[:, c.n_d % _W_SLOTS, :, 0:bw]
        c.n_d += 1
        if I % _P == 0:         # row ci * 128 + p on partition p, chunk ci: a DMA per group
            for c0, nc in _runs(c.ni):
                nisa.dma_copy(dst=wd[:, c0:c0 + nc, :],
                              src=c.wd.ap(pattern=[[H, _P], [_P * H, nc], [1, bw]],
                                          offset=e * I * H + c0 * _P * H + b0))
        else:
            for ci in range(c.ni):
                iw = min(_P, I - ci * _P)
                nisa.dma_copy(dst=wd[0:iw, ci, :], src=c.wd[e, ci * _P:ci * _P + iw, b0:b0 + bw])
        for j0 in range(0, bw, _BANK):
            hw, h0 = min(_BANK, bw - j0), b0 + j0
            yp = c.y_ring[0:T, c.n_y % _SLOTS, 0:hw]
            c.n_y += 1
            for ci in range(c.ni):
                iw = min(_P, I - ci * _P)
                nisa.nc_matmul(dst=yp, stationary=actT[0:iw, ci, :], moving=wd[0:iw, ci, j0:j0 + hw],
                               accumulate=ci > 0)
            _accumulate(c, e, yp, w, acc, h0, hw, first)


def _accumulate(c, e, yp, w, acc, h0, hw, first):
    """acc[:, h0:h0+hw] (+)= w * (yp + bd) out of PSUM on VectorE."""
    T = c.T
    src = yp
    if c.bd is not None:
        bd = c.bd_ring[:, c.n_bd % 2, 0:hw]
        c.n_bd += 1
        nisa.dma_copy(dst=bd, src=c.bd[e:e + 1, h0:h0 + hw].ap([[0, T], [1, hw]]))
        nisa.tensor_tensor(dst=bd, data1=yp, data2=bd, op=nl.add)
        src = bd
    dst = acc[:, h0:h0 + hw]
    if first:
        if w is None:
            nisa.tensor_copy(dst=dst, src=src)
        else:
            nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=w)
    elif w is None:
        nisa.tensor_tensor(dst=dst, data1=src, data2=dst, op=nl.add)
    else:
        nisa.scalar_tensor_tensor(dst=dst, data=src, op0=nl.multiply, operand0=w, op1=nl.add,
                                  operand1=dst)
