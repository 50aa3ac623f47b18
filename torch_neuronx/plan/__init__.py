"""Plan a cluster from one machine: the modelled training or serving step of a transformer on
N Trainium chips under any parallel layout (docs/plan.md).

    from torch_neuronx import plan
    model = plan.PRESETS["llama-8b"]
    c = plan.cluster("trn2.48xlarge", chips=64)
    print(plan.training_step(model, c, plan.Layout(fsdp=64, tp=4), batch=256))
    for e in plan.sweep(model, c, batch=256)[:5]: print(e)
    print(plan.serving(model, plan.cluster("trn2.48xlarge"), tp=8, batch=32, context=4096))
"""
from .cluster import INSTANCES, Cluster, cluster
from .estimate import Estimate, training_step
from .layout import Layout
from .replay import Replay
from .serve import ServeEstimate, serving
from .sweep import layouts, sweep
from .trace import StepTrace, trace
from .workload import PRESETS, TransformerConfig

__all__ = ["INSTANCES", "Cluster", "cluster", "Estimate", "training_step", "Layout", "Replay",
           "ServeEstimate", "serving", "layouts", "sweep", "StepTrace", "trace", "PRESETS",
           "TransformerConfig"]
