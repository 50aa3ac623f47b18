"""``torchneuron plan``: the what-if of a model on a cluster, one layout or a ranked sweep,
training or serving."""
from __future__ import annotations

from .cluster import INSTANCES, cluster
from .estimate import training_step
from .layout import Layout
from .serve import serving
from .sweep import sweep
from .workload import PRESETS


def add_arguments(p) -> None:
    p.add_argument("--model", default="llama-1b", choices=sorted(PRESETS))
    p.add_argument("--instance", default="trn2.48xlarge", choices=sorted(INSTANCES))
    p.add_argument("--chips", type=int, default=None, help="default: one node")
    p.add_argument("--lnc", type=int, default=None)
    p.add_argument("--batch", type=int, default=64, help="global batch, sequences")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--layout", default=None,
                   help="e.g. 'fsdp=16,tp=4' or 'dp=2,tp=8,pp=2,mb=8,sp'; default: sweep all")
    p.add_argument("--top", type=int, default=10, help="layouts shown by the sweep")
    p.add_argument("--serve", action="store_true", help="serving: TTFT and inter-token latency")
    p.add_argument("--tp", type=int, default=None, help="serving: tensor parallel degree")
    p.add_argument("--context", type=int, default=4096, help="serving: context length")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="sweep: write breakdown.png and scaling.png to DIR")


def parse_layout(text: str) -> Layout:
    kw = {}
    for part in filter(None, (s.strip() for s in text.split(","))):
        if part in ("sp", "recompute"):
            kw[part] = True
            continue
        key, _, value = part.partition("=")
        key = {"mb": "microbatches"}.get(key, key)
        if key not in ("dp", "fsdp", "tp", "pp", "ep", "microbatches") or not value.isdigit():
            raise ValueError(f"layout term {part!r}: expected dp=, fsdp=, tp=, pp=, ep=, mb=, sp or recompute")
        kw[key] = int(value)
    return Layout(**kw)


def run(args) -> int:
    try:
        return _run(args)
    except ValueError as e:  # a layout or cluster that does not fit: say which, exit 2
        print(f"torchneuron plan: error: {e}")
        return 2


def _run(args) -> int:
    model = PRESETS[args.model]
    if args.seq:
        model = model.__class__(**{**model.__dict__, "seq": args.seq})
    c = cluster(args.instance, args.chips, args.lnc)
    print(f"{model.name}: {model.params() / 1e9:.2f}B parameters, seq {model.seq}; {c.name} x "
          f"{c.chips} chips ({c.nodes} node(s)), LNC={c.lnc}: {c.devices} devices")
    if args.serve:
        tps = [args.tp] if args.tp else [t for t in (1, 2, 4, 8, 16, 32, 64)
                                          if t <= c.devices and model.heads % t == 0
                                          and (model.kv_heads or model.heads) % t == 0]
        for tp in tps:
            print(serving(model, c, tp, args.batch, args.context))
        return 0
    if args.layout:
        print(training_step(model, c, parse_layout(args.layout), args.batch))
        return 0
    ests = sweep(model, c, args.batch)
    print(f"{len(ests)} layouts; the {min(args.top, len(ests))} fastest that fit first:")
    for e in ests[:args.top]:
        print(e)
    if args.plot:
        import os
        from .plots import plot_breakdown, plot_scaling
        os.makedirs(args.plot, exist_ok=True)
        plot_breakdown(ests, os.path.join(args.plot, "breakdown.png"), top=args.top)
        per_node = INSTANCES[args.instance][1]
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= per_node or n % per_node == 0]
        counts = [n for n in counts if n <= max(c.chips, per_node) * 4]
        plot_scaling(model, args.instance, counts, max(1, args.batch // c.devices),
                     os.path.join(args.plot, "scaling.png"))
        print(f"plots: {args.plot}/breakdown.png, {args.plot}/scaling.png")
    return 0
