"""The cluster what-if: conservation and monotonic properties, public arithmetic, the device's
own accounting of a real step, and clear errors for layouts that do not fit."""
import dataclasses
import math

import pytest
import torch

from torch_neuronx import plan
from torch_neuronx.demo.gpt import GPT, GPTConfig

LLAMA_1B = plan.PRESETS["llama-1b"]


def test_parameter_counts_match_the_published_models():
    # Llama 3.2 1B: 1.24B parameters; Llama 3 8B: 8.03B; 70B: 70.6B (Meta's model cards).
    assert abs(plan.PRESETS["llama-1b"].params() / 1e9 - 1.24) < 0.01
    assert abs(plan.PRESETS["llama-8b"].params() / 1e9 - 8.03) < 0.01
    assert abs(plan.PRESETS["llama-70b"].params() / 1e9 - 70.6) < 0.1


def test_training_flops_are_six_n_per_token_plus_attention():
    m, seqs = plan.PRESETS["llama-8b"], 4
    tokens = seqs * m.seq
    attention = 3 * m.layers * 2 * 2 * tokens * m.seq * m.hidden  # QK^T and AV, fwd + 2x bwd
    embed_lookup = 6 * m.vocab * m.hidden * tokens                 # the input table does no matmul
    assert m.train_flops(seqs) == pytest.approx(6 * m.params() * tokens + attention - embed_lookup, rel=1e-3)


def test_planned_flops_equal_what_the_device_counts_for_a_real_step():
    cfg = GPTConfig()
    model = GPT(cfg).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), device="neuron")
    with plan.trace() as t:
        _, loss = model(x, x)
        loss.backward()
        opt.step()
    planned = plan.PRESETS["gpt-demo"].train_flops(2)
    assert t.flops > 0
    assert t.flops == pytest.approx(planned, rel=0.02)


def test_more_chips_never_slow_pure_compute():
    prev = math.inf
    for chips in (1, 2, 4, 8, 16):
        c = plan.cluster("trn2.48xlarge", chips=chips)
        est = plan.training_step(LLAMA_1B, c, plan.Layout(dp=c.devices), batch=64)
        assert est.breakdown["compute"] <= prev + 1e-12
        prev = est.breakdown["compute"]


def test_flops_are_conserved_across_layouts_and_terms_are_non_negative():
    c = plan.cluster("trn2.48xlarge", chips=4)
    ests = plan.sweep(LLAMA_1B, c, batch=32)
    assert len(ests) > 10
    assert {e.flops for e in ests} == {LLAMA_1B.train_flops(32)}
    for e in ests:
        assert all(v >= 0 for v in e.breakdown.values()), e
        assert e.step_seconds == pytest.approx(sum(e.breakdown.values()))
        assert 0 < e.mfu < 1
    fitting = [e for e in ests if e.fits]
    assert fitting and ests[0] in fitting
    assert [e.step_seconds for e in fitting] == sorted(e.step_seconds for e in fitting)


def test_tensor_parallel_divides_matmul_time_and_adds_communication():
    c = plan.cluster("trn2.48xlarge", chips=1)
    one = plan.training_step(LLAMA_1B, c, plan.Layout(dp=4), batch=8)
    tp = plan.training_step(LLAMA_1B, c, plan.Layout(tp=4), batch=8)
    assert tp.breakdown["tp_comm"] > 0 and one.breakdown["tp_comm"] == 0
    # tp=4 runs the same tokens per device 4x (one replica instead of four) on a quarter of
    # each matmul: the compute per step stays within the tiling granularity of the quarter.
    assert tp.breakdown["compute"] == pytest.approx(one.breakdown["compute"], rel=0.1)


def test_pipeline_bubble_is_the_1f1b_formula():
    c = plan.cluster("trn2.48xlarge", chips=2)
    for m in (4, 8, 16):
        e = plan.training_step(LLAMA_1B, c, plan.Layout(dp=2, pp=4, microbatches=m), batch=32)
        stage = (e.breakdown["compute"] + e.breakdown["launch"] + e.breakdown["pp_p2p"]) / m
        assert e.breakdown["pp_bubble"] == pytest.approx(3 * stage, rel=1e-6)


def test_collectives_come_from_the_backends_model():
    from torch_neuronx.distributed.collectives_model import collective_seconds
    c = plan.cluster("trn2.48xlarge", chips=16)
    e = plan.training_step(LLAMA_1B, c, plan.Layout(dp=64), batch=64)
    grads = LLAMA_1B.params() * 2
    ar = collective_seconds("all_reduce", grads, 64, 1, c.fabric, c.lnc)
    backward = 2 * (e.breakdown["compute"] - 0) / 3
    assert e.breakdown["dp_exposed"] <= ar
    assert e.breakdown["dp_exposed"] >= ar - backward - 1e-12


def test_decode_is_bandwidth_bound():
    m = plan.PRESETS["llama-8b"]
    c = plan.cluster("trn2.48xlarge")
    s = plan.serving(m, c, tp=4, batch=1, context=1024)
    hbm = c.profile.core_hbm_bandwidth(c.lnc)
    stream = (m.active_params() * 2 / 4) / hbm  # each device streams its quarter of the weights
    assert stream <= s.itl_seconds < 1.5 * stream + 2e-3
    assert s.ttft_seconds > s.itl_seconds
    assert s.kv_cache_bytes == 2 * m.layers * m.kv_dim * 2 // 4 * 1024


def test_memory_verdict():
    m = plan.PRESETS["llama-70b"]
    c = plan.cluster("trn2.48xlarge", chips=1)
    e = plan.training_step(m, c, plan.Layout(dp=4), batch=4)
    assert not e.fits and "DOES NOT FIT" in str(e)
    big = plan.cluster("trn2-ultraserver", chips=64)
    best = plan.sweep(m, big, batch=256)[0]
    assert best.fits


@pytest.mark.parametrize("layout,match", [
    (plan.Layout(dp=3), "uses 3 devices"),
    (plan.Layout(tp=64), "does not divide the 32 attention heads"),
    (plan.Layout(dp=2, pp=32), "pp=32 does not divide 16 layers"),
    (plan.Layout(dp=16, pp=4, microbatches=3), "does not split"),
    (plan.Layout(dp=64, sp=True), "sequence parallelism needs tp > 1"),
    (plan.Layout(dp=64, ep=2), "ep=2 must divide the 1 experts"),
])
def test_bad_layouts_raise_clear_errors(layout, match):
    c = plan.cluster("trn2.48xlarge", chips=16)
    with pytest.raises(ValueError, match=match):
        plan.training_step(LLAMA_1B, c, layout, batch=64)


def test_bad_clusters_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown instance type"):
        plan.cluster("p5.48xlarge")
    with pytest.raises(ValueError, match="whole nodes"):
        plan.cluster("trn2.48xlarge", chips=24)


def test_mixture_of_experts_shards_experts_and_pays_all_to_all():
    moe = dataclasses.replace(LLAMA_1B, experts=8, top_k=2, name="moe")
    c = plan.cluster("trn2.48xlarge", chips=2)
    e = plan.training_step(moe, c, plan.Layout(dp=8, ep=8), batch=16)
    assert e.breakdown["ep_all_to_all"] > 0
    dense = plan.training_step(moe, c, plan.Layout(dp=8), batch=16)
    assert e.hbm_bytes < dense.hbm_bytes


def test_cli_sweep_and_error(capsys):
    from torch_neuronx.cli import main
    assert main(["plan", "--model", "llama-1b", "--chips", "2", "--batch", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts; the 3 fastest" in out and "MFU" in out
    assert main(["plan", "--model", "llama-1b", "--layout", "tp=3"]) == 2
    assert "uses 3 devices" in capsys.readouterr().out


def test_plots_hold_the_estimates(tmp_path):
    from torch_neuronx.plan.plots import plot_breakdown, plot_scaling
    c = plan.cluster("trn2.48xlarge", chips=2)
    ests = plan.sweep(LLAMA_1B, c, batch=16)
    rows = plot_breakdown(ests, str(tmp_path / "b.png"), top=4)
    assert [r[0] for r in rows] == [str(e.layout) for e in ests[:4]]
    assert all(sum(r[1].values()) == pytest.approx(e.step_seconds) for r, e in zip(rows, ests))
    assert (tmp_path / "b.png").stat().st_size > 1000
    pts = plot_scaling(LLAMA_1B, "trn2.48xlarge", [1, 2, 4], 1, str(tmp_path / "s.png"))
    assert [p[0] for p in pts] == [1, 2, 4]
    assert pts[0][3] < pts[1][3] < pts[2][3]  # more chips, more tokens/s (weak scaling)
    assert (tmp_path / "s.png").stat().st_size > 1000


def _ranks(n):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _plan_ranks import ranks
    return ranks(n, "_ddp_step.py")


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_what_if_equals_a_real_run(world):
    """A DDP step traced on one rank, replayed for N ranks, equals the modelled time each rank
    of a real N-rank run on the virtual devices reports."""
    one = _ranks(1)[0]
    assert one["collectives"] and all(c[0] == "all_reduce" and c[2] == 1 for c in one["collectives"])
    real = _ranks(world)
    predicted = one[f"replay{world}"]
    assert one[f"layout{world}"] == pytest.approx(predicted, rel=1e-12)   # replay_layout(dp=N)
    for r in real:
        assert [c[1] for c in r["collectives"]] == [c[1] for c in one["collectives"]]
        assert r["seconds"] == pytest.approx(predicted, rel=1e-6)
    # the same step profiled (torch.profiler, NeuronProfiler's Parquet export) and read back
    # with StepTrace.from_profile: the traced totals (modelled_ns rounds each event to 1 ns)
    # and collectives, so the same what-if
    p = one["profile"]
    assert p["collectives"] == [[c[0], c[1], c[2], c[3], pytest.approx(c[4], abs=1e-9)]
                                for c in one["collectives"]]
    for key in ("flops", "hbm_bytes", "link_bytes", "launches"):
        assert p[key] == one[key], key
    assert p["seconds"] == pytest.approx(one["seconds"], rel=1e-6)
    assert p["replay4"] == pytest.approx(one["replay4"], rel=1e-6)
    assert p["layout4"] == pytest.approx(one["layout4"], rel=1e-6)
    for r in real:
        assert r["seconds"] == pytest.approx(p[f"replay{world}"], rel=1e-6)


def test_a_profile_without_the_kineto_plugin_is_refused(tmp_path):
    """``StepTrace.from_profile`` needs the Kineto plugin's rows (what the cost model charged
    per kernel, collectives with their groups): a profile of the CPU activity alone says so;
    a device left out of the capture too."""
    from torch.profiler import ProfilerActivity
    from torch_neuronx.profiling import NeuronConfig, NeuronProfiler
    x = torch.ones(64, 64, device="neuron")
    for activities, name in (([ProfilerActivity.CPU], "cpu"),
                             ([ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], "both")):
        cfg = NeuronConfig(profile_output_dir=str(tmp_path / name))
        handler = NeuronProfiler(cfg)
        with torch.profiler.profile(activities=activities, experimental_config=cfg,
                                    on_trace_ready=handler.export_trace):
            (x @ x).sum().item()
        handler.close()
    with pytest.raises(ValueError, match=r"profiled without the Kineto plugin "
                                         r"\(hardware_source='cost_model'\); profile the step "
                                         r"with activities=\[ProfilerActivity.CPU, "
                                         r"ProfilerActivity.PrivateUse1\]"):
        plan.StepTrace.from_profile(tmp_path / "cpu" / "trace_0")
    t = plan.StepTrace.from_profile(tmp_path / "both" / "trace_0")
    assert t.flops == 2 * 64 ** 3 and not t.collectives and t.seconds > 0
    with pytest.raises(ValueError, match=r"no hardware events of device 1"):
        plan.StepTrace.from_profile(tmp_path / "both" / "trace_0", device=1)
    # an export from before collectives kept their groups
    import pyarrow as pa
    import pyarrow.parquet as pq
    meta = tmp_path / "both" / "trace_0" / "Metadata.parquet"
    rows = pq.read_table(meta).to_pydict()
    rows["value"] = ["1.6.0" if k == "profile_schema_version" else v
                     for k, v in zip(rows["key"], rows["value"])]
    pq.write_table(pa.table(rows), meta)
    with pytest.raises(ValueError, match=r"has schema 1.6.0; collectives' groups are recorded "
                                         r"from 1.7.0 on"):
        plan.StepTrace.from_profile(tmp_path / "both" / "trace_0")
