"""`k3ray bench cluster`: decode throughput of the tiny K3 run locally vs as Ray actors
(pipeline 2 x expert-parallel 2), the Ray cost of a pipeline hop and of one MoE dispatch per
layer, and the same decode loop through Ray Compiled Graphs.

dispatch_ms_per_layer is the latency one MoE layer's dispatch adds over computing the same rows'
experts locally, with the --moe-dispatch mode; dispatch_added_ms holds each mode measured (through
the router actor, from the caller straight to the shards, and with --moe-dispatch compiled the
stage's compiled graph, timed inside that stage) and dispatch_total_ms their wall times;
dispatch_floor_ms is the direct mode's calls with the same payloads answered without work (what Ray
alone costs on this machine at the time).

--workload skewed measures expert balancing instead (bench/cluster_skewed.py)."""

from __future__ import annotations

import argparse
import os
import statistics
import time

from k3ray.actors.pipeline.config import DEFAULT_MOE_DISPATCH, MOE_DISPATCH_MODES
from k3ray.bench.common import machine
from k3ray.cli_flags import add_deprecated_alias

HELP = "decode local vs Ray actors, pipeline hop and MoE dispatch cost"
BLOCK = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny K3)")
    p.add_argument("--pipeline", type=int, default=2, help="pipeline stages of the Ray runner")
    p.add_argument("--expert-parallel", type=int, default=2, help="expert shards per stage")
    p.add_argument("--decode-batch", type=int, default=8, help="sequences decoded together")
    add_deprecated_alias(p, "--batch", "--decode-batch", dest="decode_batch", type=int)
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps per repetition")
    add_deprecated_alias(p, "--steps", "--decode-steps", dest="decode_steps", type=int)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case (median)")
    p.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument("--moe-dispatch", choices=MOE_DISPATCH_MODES, default=DEFAULT_MOE_DISPATCH,
                   help="how the Ray runner's stages reach the expert shards")
    p.add_argument("--workload", choices=("uniform", "skewed"), default="uniform",
                   help="uniform: the tiny K3 as is; skewed: one hot expert, shard load and step time "
                        "before and after the router's expert rebalancing")
    p.add_argument("--redundant-experts", type=int, default=None,
                   help="replica slots per expert shard for --workload skewed (default: ParallelConfig's)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch CPU threads of this process and of each stage and shard actor")


def _decode_args(batch: int, step: int, prompt: int):
    # lazy: ray and torch stay out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.engine.execution.plan import BatchPlan

    tables = torch.arange(batch * 8).view(batch, 8)
    return BatchPlan(torch.randint(0, 256, (batch,)), torch.arange(batch + 1), torch.full((batch,), prompt + step + 1),
                     torch.arange(batch), tables, logits_indices=torch.arange(batch))


def _prefill_args(batch: int, prompt: int):
    # lazy: ray and torch stay out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.engine.execution.plan import BatchPlan

    tables = torch.arange(batch * 8).view(batch, 8)
    return BatchPlan(torch.randint(0, 256, (batch * prompt,)), torch.arange(batch + 1) * prompt,
                     torch.full((batch,), prompt), torch.arange(batch), tables,
                     logits_indices=torch.arange(batch * prompt))


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(_times_ms(fn, repeats))


def _times_ms(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return times


def _interleaved_medians(timed: dict, rounds: int, per_round: int) -> dict[str, float]:
    """{name: fn(n) -> n times in ms} -> the median of each, the names taking turns (this machine's
    speed drifts over seconds, and each difference the benchmark reports should see the same)."""
    samples = {name: [] for name in timed}
    for fn in timed.values():
        fn(per_round)  # warm-up
    for _ in range(rounds):
        for name, fn in timed.items():
            samples[name] += fn(per_round)
    return {name: statistics.median(v) for name, v in samples.items()}


def run(args: argparse.Namespace) -> dict:
    # lazy: ray and torch stay out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.actors.pipeline.config import ParallelConfig

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # lazy: ray and torch stay out of `k3ray bench --help` (it loads every benchmark)
    import ray

    from k3ray.actors.cluster.ray_connect import connect  # ray.init off the repository root
    from k3ray.actors.pipeline.executor import RayExecutor
    from k3ray.actors.pipeline.moe_dispatch import fan_out, split
    from k3ray.actors.pipeline.protocol import CacheSpec
    from k3ray.actors.pipeline.wire import pack, unpack_raw
    from k3ray.default_model import checkpoint_dir
    from k3ray.models.forward_batch import ModelCache
    from k3ray.weights import load_model

    ckpt = checkpoint_dir(args.model)
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)  # the same as each actor: a fair comparison
    B, prompt = args.decode_batch, 8
    spec = CacheSpec(num_state_slots=B, num_blocks=B * 8, block_size=BLOCK)
    local = load_model(ckpt, torch.float32).eval()
    local_cache = ModelCache.allocate(local.config, B, B * 8, BLOCK)

    def local_step(a):
        with torch.inference_mode():  # as the local executor (and each stage actor) runs
            local(a.input_ids, a.forward_batch(local_cache))

    if args.address:
        connect(address=args.address, include_dashboard=False, log_to_driver=False)
    else:
        connect(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    if args.workload == "skewed":
        # lazy: ray and torch stay out of `k3ray bench --help` (it loads every benchmark)
        from k3ray.actors.bench.cluster_skewed import run_skewed

        if args.redundant_experts is None:
            args.redundant_experts = ParallelConfig().redundant_experts
        try:
            out = run_skewed(args, ckpt, spec, _decode_args, _prefill_args)
        finally:
            ray.shutdown()
        return {**out, "machine": machine(),
                "config": {"model": ckpt, "workload": "skewed", "pipeline": args.pipeline,
                           "expert_parallel": args.expert_parallel, "moe_dispatch": args.moe_dispatch,
                           "redundant_experts": args.redundant_experts, "batch": B, "steps": args.decode_steps, "threads": args.threads,
                           "repeats": args.repeats}}
    try:
        parallel = ParallelConfig(args.pipeline, args.expert_parallel, moe_dispatch=args.moe_dispatch,
                                  torch_threads=args.threads)
        runner = RayExecutor(ckpt, parallel, spec)
        single = RayExecutor(ckpt, ParallelConfig(1, args.expert_parallel, moe_dispatch=args.moe_dispatch,
                                                         torch_threads=args.threads), spec,
                                name="k3ray-single")

        def loop(step_fn):
            step_fn(_prefill_args(B, prompt))
            for s in range(args.decode_steps):
                step_fn(_decode_args(B, s, prompt))

        local_ms, ray_ms, single_ms = [], [], []
        for _ in range(args.repeats):  # interleaved: the machine is shared and noisy
            local_ms.append(_median_ms(lambda: loop(local_step), 1))
            ray_ms.append(_median_ms(lambda: loop(runner.step), 1))
            single_ms.append(_median_ms(lambda: loop(single.step), 1))
        single.shutdown()  # idle actors still take a little of the 2 cores from the timings below
        tokens = B * args.decode_steps
        local_tok_s = tokens / (statistics.median(local_ms) / 1000)
        ray_tok_s = tokens / (statistics.median(ray_ms) / 1000)

        # one pipeline hop: a decode step's carry (hidden + bank) relayed through the stages
        stages = [g.stage for g in runner.groups]
        D = local.config.hidden_size
        carry = pack(torch.randn(B, D), torch.randn(B, 4, D))

        def relay_chain():
            ref = carry
            for st in stages:
                ref = st.relay.remote(ref)
            ray.get(ref)

        hop_ms = _median_ms(relay_chain, 20 * args.repeats) / len(stages)

        # one MoE dispatch of a decode step's latent rows: via the router, or straight to the shards
        group = next(g for g in runner.groups if g.router is not None)
        router = group.router
        layer = next(i for i in range(*group.layers) if local.config.is_moe_layer(i))
        moe = local.model.layers[str(layer)].block_sparse_moe
        x = torch.randn(B, D)
        weights, ids = moe.gate(x)
        h = moe.routed_expert_down_proj(x).detach()
        rows = pack(h, ids, weights, tag=layer)
        targets, bundles, _ = split(group.shards, layer, h, ids, weights)
        timed = {
            # the same calls with the same payloads, answered without work: Ray's floor right now
            "floor": lambda n: _times_ms(lambda: ray.get([s.relay.remote(b) for s, b in zip(targets, bundles)]), n),
            "router": lambda n: _times_ms(lambda: unpack_raw(ray.get(router.dispatch.remote(rows)), torch.float32, h.shape), n),
            "direct": lambda n: _times_ms(lambda: fan_out(group.shards, layer, h, ids, weights, 60.0), n),
            "local": lambda n: _times_ms(lambda: moe.experts(h, ids, weights), n),
        }
        if args.moe_dispatch == "compiled":  # timed inside the stage that drives the compiled graph
            timed["compiled"] = lambda n: ray.get(group.stage.dispatch_times_ms.remote(rows, n))
        with torch.inference_mode():
            total_ms = _interleaved_medians(timed, rounds=4 * args.repeats, per_round=25)
        expert_ms = total_ms.pop("local")
        floor_ms = total_ms.pop("floor")
        added_ms = {mode: ms - expert_ms for mode, ms in total_ms.items()}
        moe_layers = sum(local.config.is_moe_layer(i) for i in range(local.config.num_layers))
        compiled = _compiled_graph(runner, B, prompt, args, local_ms, tokens)
        runner.shutdown()
    finally:
        ray.shutdown()
    return {
        "ray_vs_local_tok_s": ray_tok_s / local_tok_s,
        "hop_ms": hop_ms,
        "dispatch_ms_per_layer": added_ms[args.moe_dispatch],
        "dispatch_added_ms": added_ms,
        "dispatch_total_ms": total_ms,
        "dispatch_floor_ms": floor_ms,
        "compiled_graphs": compiled,
        "local_decode_tok_s": local_tok_s,
        "ray_decode_tok_s": ray_tok_s,
        "local_step_ms": statistics.median(local_ms) / (args.decode_steps + 1),
        "ray_step_ms": statistics.median(ray_ms) / (args.decode_steps + 1),
        "ray_single_stage_step_ms": statistics.median(single_ms) / (args.decode_steps + 1),
        "expert_compute_ms_per_layer": expert_ms,
        "moe_layers": moe_layers,
        "machine": machine(),
        "config": {"model": ckpt, "pipeline": args.pipeline, "expert_parallel": args.expert_parallel,
                   "moe_dispatch": args.moe_dispatch, "batch": B,
                   "steps": args.decode_steps, "repeats": args.repeats},
    }


def _compiled_graph(runner, B: int, prompt: int, args, local_ms, tokens) -> dict | None:
    """The steady decode loop through a Ray Compiled Graph of the stage chain (the MoE dispatch
    inside each stage stays a plain actor call). None where Compiled Graphs fail here."""
    # lazy: ray and torch stay out of `k3ray bench --help` (it loads every benchmark)
    import ray
    from ray.dag import InputNode

    try:
        with InputNode() as inp:
            node = None
            for g in runner.groups:
                node = g.stage.forward.bind(inp, node)
        dag = node.experimental_compile()
    except Exception as e:  # noqa: BLE001 - unsupported setups report null
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        def loop():
            ray.get(dag.execute(_prefill_args(B, prompt)), timeout=120)  # logits come back packed
            for s in range(args.decode_steps):
                ray.get(dag.execute(_decode_args(B, s, prompt)), timeout=120)

        ms = [_median_ms(loop, 1) for _ in range(args.repeats)]
        tok_s = tokens / (statistics.median(ms) / 1000)
        return {"ray_vs_local_tok_s": tok_s / (tokens / (statistics.median(local_ms) / 1000)),
                "decode_tok_s": tok_s, "step_ms": statistics.median(ms) / (args.decode_steps + 1)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        dag.teardown()
