"""``torchneuron``: ``ls`` (like neuron-ls), ``demo`` (the main job), ``explore`` (profiles) and ``plan`` (cluster what-if)."""
from __future__ import annotations

import argparse
import sys


def _ls(args) -> int:
    import torch

    from . import _state
    cfg = _state.config()
    p = cfg.profile
    print(f"platform: {p.name} ({p.chip}, {p.core_version}, NKI target {p.nki_target}); "
          f"LNC={cfg.lnc}: {cfg.lnc} physical core(s) per device")
    print(f"chip: {p.physical_cores} NeuronCores, {p.hbm_bytes / 2**30:.0f} GiB HBM at "
          f"{p.hbm_bandwidth / 1e12:.1f} TB/s, NeuronLink {p.neuronlink_bandwidth / 1e12:.2f} TB/s")
    header = f"{'device':<10}{'core':>6}{'HBM':>12}{'allocated':>12}{'reserved':>12}{'BF16 TFLOPS':>13}{'FP32 TFLOPS':>13}"
    print(header)
    print("-" * len(header))
    for i in range(torch.neuron.device_count()):
        props = torch.neuron.get_device_properties(i)
        print(f"{'neuron:' + str(i):<10}{props.core_id:>6}{props.total_memory / 2**30:>9.1f} GiB"
              f"{torch.neuron.memory_allocated(i) / 2**20:>8.1f} MiB"
              f"{torch.neuron.memory_reserved(i) / 2**20:>8.1f} MiB"
              f"{props.peak_tflops['bfloat16']:>13.0f}{props.peak_tflops['float32']:>13.0f}")
    print(f"{torch.neuron.device_count()} virtual device(s): {torch.neuron._describe()}")
    return 0


def _demo(args) -> int:
    from .demo.run import run
    return run(steps=args.steps, batch=args.batch, compile=not args.no_compile,
               device=args.device, autocast=args.bf16)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list the virtual NeuronCores, the hardware profile and memory")
    demo = sub.add_parser("demo", help="train a small GPT on neuron, eager then compiled")
    demo.add_argument("--steps", type=int, default=500)
    demo.add_argument("--batch", type=int, default=16)
    demo.add_argument("--device", default="neuron")
    demo.add_argument("--bf16", action="store_true", help="train under bf16 autocast")
    demo.add_argument("--no-compile", action="store_true", help="skip the compiled run")
    from .profiling import explore
    explore.add_arguments(sub.add_parser("explore", help="bottleneck report of a profile directory"))
    from .plan import cli as plan_cli
    plan_cli.add_arguments(sub.add_parser("plan", help="model a training or serving step on N Trainium chips"))
    args = parser.parse_args(argv)
    return {"ls": _ls, "demo": _demo, "explore": explore.run, "plan": plan_cli.run}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
