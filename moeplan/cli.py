"""The ``moeplan`` command line: compile, explore, describe, simulate, schema, run, diff, inspect, timeline, export.

Errors in user input exit 2 and a plan that cannot fit exits 3, each with one line on stderr and no traceback
(docs/architecture.md §8.7); output files are written atomically.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import sys
from typing import Optional

import typer
from rich.text import Text

from moeplan.cli_errors import (GuardedGroup, Invocation, StdoutConsole, err, exit_on_broken_pipe, exit_on_error,
                                exit_on_interrupt, invocation_of, warn)
from moeplan.cli_options import (OVERLAP_HELP, PIPELINE_HELP, RAY_HELP, choice, expert_load_model, integer, positive,
                                run_request, strategy_options)
from moeplan.errors import LayoutError, PlanError
from moeplan.interrupts import keep_swallowed_interrupts

app = typer.Typer(cls=GuardedGroup, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Compile MoE training jobs into execution plans.")
PIPE_WIDTH = 100_000
"""Columns of stdout when it is not a terminal (a pipe, a file, a CI log) and COLUMNS is not set: wide enough that
no line or table is wrapped or truncated, so each prints at its content's width (rich's default is 80)."""
VIEW_PIPE_WIDTH = 200
"""Columns of ``inspect`` off a terminal (COLUMNS not set): its views stretch to the console (expanding tables, a
Gantt over every column), so they get a fixed width instead; 200 holds the views of the 718B default plan (6144
Ascend 910B) without a wrapped or truncated cell."""
out = StdoutConsole(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else PIPE_WIDTH)


PRODUCTION_METER_EVERY = 100
"""``--meter-every`` of a run under torchrun (or the command printed for one) when not given: the meter's hooks slow
the steps they measure, so a production run measures its first step and one in 100 after it."""


def read_model_warning(ref: str):
    """The ModelSpec of ``ref`` (:func:`moeplan.spec.read_model`); first, on stderr, one warning line naming the
    keys of a config.json that moeplan does not model."""
    from moeplan.spec import read_model

    model = read_model(ref)
    line = model.warning()
    if line:
        warn(line)
    return model.spec


@app.command("compile")
def compile_cmd(
    model: str = typer.Argument(..., help="registry name, moeplan YAML or HF config.json"),
    target: str = typer.Option(..., "--target", help="target name (e.g. ascend-910b, ascend-910b:313t) or YAML"),
    devices: int = typer.Option(..., "--devices", help="number of devices"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="write the plan YAML here"),
    devices_per_node: Optional[int] = typer.Option(None, "--devices-per-node",
                                                   help="devices per node (default: the target's)"),
    tp: Optional[int] = typer.Option(None, "--tp", help="tensor-parallel degree (default: searched)"),
    pp: Optional[int] = typer.Option(None, "--pp", help="pipeline-parallel degree (default: searched)"),
    vpp: Optional[int] = typer.Option(None, "--vpp", help="virtual pipeline chunks per PP rank (default: searched)"),
    ep: Optional[int] = typer.Option(None, "--ep", help="expert-parallel degree (default: searched)"),
    etp: Optional[int] = typer.Option(None, "--etp", help="expert tensor-parallel degree: tp for expert-TP, 1 for "
                                                          "TP-extend-EP (default: searched)"),
    cp: Optional[int] = typer.Option(None, "--cp", help="context-parallel degree (default: searched)"),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch",
                                              help="sequences per micro-batch (default: searched)"),
    dp_shard: Optional[str] = typer.Option(None, "--dp-shard",
                                           help="FSDP degree over the DP replicas (torchtitan data_parallel_shard_"
                                                "degree), or auto: try every layout fully sharded too (default: 1, "
                                                "ZeRO-1)"),
    global_batch: Optional[int] = typer.Option(None, "--global-batch",
                                               help="sequences per step (default: the model's; the summary says "
                                                    "where it came from)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="tokens per sequence (default: the model's)"),
    schedule: str = typer.Option("auto", "--schedule", help="1f1b|interleaved|zero-bubble|zbv|dualpipev|auto"),
    dispatcher: str = typer.Option("auto", "--dispatcher", help="EP token dispatcher: flat|hierarchical|dedup|auto"),
    overlap: str = typer.Option("auto", "--overlap", help=OVERLAP_HELP),
    recompute: str = typer.Option("auto", "--recompute",
                                  help="auto|none|selective|full (whole layers; auto: per PP rank), "
                                       "mindspeed|ilp-no-swap|ilp (per saved tensor), or modules:LIST in "
                                       "Megatron-LM's --recompute-modules names (core_attn,mlp,moe_act,layernorm,"
                                       "mla_up_proj,moe,shared_experts)"),
    memory_budget: Optional[float] = typer.Option(None, "--memory-budget",
                                                  help="GiB per device the plan may use (plan-memory{budget_gib=})"),
    training_dtype: Optional[str] = typer.Option(None, "--training-dtype",
                                                 help="bf16|fp16|fp32|fp8 (fp8: GEMMs; overrides the target)"),
    runtime: Optional[str] = typer.Option(None, "--runtime",
                                          help="megatron-lm|mindspeed-llm: plan only what that runtime runs "
                                               "(overrides the target's runtime.name; docs/export.md)"),
    grad_dtype: str = typer.Option("fp32", "--grad-dtype",
                                   help="fp32|bf16: gradient buffer and DP reduction (Megatron-LM "
                                        "--grad-reduce-in-bf16 for bf16)"),
    main_params_dtype: str = typer.Option("fp32", "--main-params-dtype",
                                          help="fp32|bf16|fp16: the optimizer's master weights (Megatron-LM "
                                               "--main-params-dtype)"),
    optimizer_dtype: str = typer.Option("fp32", "--optimizer-dtype",
                                        help="fp32|bf16: Adam's moments (Megatron-LM --exp-avg-dtype, "
                                             "--exp-avg-sq-dtype)"),
    distributed_optimizer: bool = typer.Option(True, "--distributed-optimizer/--no-distributed-optimizer",
                                               help="shard master weights and moments over DP (ZeRO-1)"),
    fp8_activation_input: bool = typer.Option(False, "--fp8-activation-input",
                                              help="with --training-dtype fp8, the SwiGLU keeps its input in FP8 "
                                                   "(Megatron-LM's activation_func_fp8_input_store)"),
    pipeline: Optional[str] = typer.Option(None, "--pipeline", help=PIPELINE_HELP),
    expert_load: Optional[str] = typer.Option(None, "--expert-load",
                                              help="price imbalanced routing from this expert-load trace "
                                                   "(docs/load-balance.md; default: balanced routing)"),
    expert_load_window: Optional[str] = typer.Option(None, "--expert-load-window",
                                                     help="START:STOP positions of the trace's steps to use "
                                                          "(default: all)"),
    expert_policy: Optional[str] = typer.Option(None, "--expert-policy",
                                                help="place-experts policy: contiguous|greedy|eplb (default: "
                                                     "contiguous)"),
    expert_replicas: Optional[int] = typer.Option(None, "--expert-replicas",
                                                  help="eplb: extra expert slots per EP rank for replicas"),
    rebalance_every: Optional[int] = typer.Option(
        None, "--rebalance-every", help="with --expert-load: price a run that re-places the experts every N steps "
                                        "and moves them (moeplan run takes N from the plan; docs/load-balance.md)"),
    rebalance_threshold: Optional[float] = typer.Option(
        None, "--rebalance-threshold", help="with --rebalance-every: the imbalance gain a layer's new placement "
                                            "must exceed (default 0.05)"),
    top: int = typer.Option(1, "--top", help="print the best K layouts"),
    candidates: int = typer.Option(4, "--candidates",
                                   help="best estimates simulated with the full pipeline (at least --top), then as many "
                                        "follow-ups at most whose corrected estimate beats the best found"),
    exact: bool = typer.Option(False, "--exact", help="simulate every layout whose lower bound is below the best "
                                                      "found: the optimum under the cost model (slow)"),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS", help=RAY_HELP),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary instead of tables"),
) -> None:
    """Compile MODEL for DEVICES devices of TARGET into a plan."""
    from moeplan.cli_progress import SearchStatus
    from moeplan.compile import compile_model
    from moeplan.compiler import DEFAULT_PIPELINE, Pipeline
    from moeplan.files import check_output
    from moeplan.plan import save_plan
    from moeplan.ray_pool import require as require_ray
    from moeplan.render import (layout_dict, predicted_dict, render_plan, render_search, search_dict, search_summary,
                                shape_sources)
    from moeplan.placement import POLICIES
    from moeplan.search import Fixed, check_pipeline
    from moeplan.runtimes import RUNTIMES
    from moeplan.state import Precision
    from moeplan.targets import load_target

    for name, v in (("devices", devices), ("devices_per_node", devices_per_node), ("tp", tp), ("pp", pp),
                    ("vpp", vpp), ("ep", ep), ("etp", etp), ("cp", cp), ("micro_batch", micro_batch),
                    ("global_batch", global_batch), ("seq_len", seq_len), ("top", top),
                    ("candidates", candidates)):
        positive(name, v)
    if output:
        check_output(output)  # before the work: a compile does not end in a refusal to write
    spec = read_model_warning(model).with_shape(seq_len=seq_len, global_batch=global_batch)
    tgt = load_target(target, devices_per_node=devices_per_node, training_dtype=choice(
        "training_dtype", training_dtype, ("bf16", "fp16", "fp32", "fp8")) if training_dtype else None,
        runtime=choice("runtime", runtime, tuple(RUNTIMES)) if runtime else None)
    shard = None if dp_shard in (None, "auto") else positive("dp_shard", integer("dp_shard", dp_shard))
    precision = Precision(grad_dtype=choice("grad_dtype", grad_dtype, ("fp32", "bf16")),
                          main_params_dtype=choice("main_params_dtype", main_params_dtype, ("fp32", "bf16", "fp16")),
                          moments_dtype=choice("optimizer_dtype", optimizer_dtype, ("fp32", "bf16")),
                          distributed_optimizer=distributed_optimizer, fp8_activation_input=fp8_activation_input)
    load = expert_load_model(expert_load, window=expert_load_window, spec=spec, target=tgt) if expert_load else None
    fixed = Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp,
                  cp=cp, micro_batch=micro_batch, dp_shard=shard, search_fsdp=dp_shard == "auto", precision=precision,
                  load=load,
                  **strategy_options(schedule=schedule, dispatcher=dispatcher, overlap=overlap, recompute=recompute))
    pipe = Pipeline.parse(pipeline or DEFAULT_PIPELINE)
    if expert_policy is not None:
        pipe = pipe.with_option("place-experts", "policy", choice("expert_policy", expert_policy, POLICIES))
    if expert_replicas is not None:
        pipe = pipe.with_option("place-experts", "replicas", expert_replicas)
    if rebalance_threshold is not None and not rebalance_every:
        raise PlanError(f"rebalance_threshold={rebalance_threshold}: applies to --rebalance-every, which is off")
    for key, value in (("rebalance_every", rebalance_every), ("rebalance_threshold", rebalance_threshold)):
        if value is not None:
            pipe = pipe.with_option("place-experts", key, value)
    if memory_budget is not None:
        if not 0 < memory_budget <= tgt.memory_bytes / 2**30:
            raise LayoutError(f"memory_budget={memory_budget}: must be a positive number of GiB no larger than the "
                              f"device memory of {tgt.name} ({tgt.memory_bytes / 2**30:.1f} GiB)")
        pipe = pipe.with_option("plan-memory", "budget_gib", memory_budget)
    check_pipeline(pipe)
    require_ray(ray)
    with SearchStatus(err) as status:  # on stderr: what the search is doing, once it runs for a second
        res = compile_model(spec=spec, target=tgt, num_devices=devices, fixed=fixed,
                            pipeline=pipe, candidates=None if exact else max(candidates, top),
                            keep=top, progress=status, ray=ray)
    if output:
        save_plan(res.plan, output)
    sources = shape_sources(model, seq_len=seq_len, global_batch=global_batch)
    if as_json:
        summary = {"layout": layout_dict(res.plan), "shape_sources": sources, "predicted": predicted_dict(res.plan),
                   "compile_s": res.compile_s, "stages": res.plan.stages.chunks,
                   "imbalance": res.plan.stages.imbalance, "stages_reason": res.plan.stages.reason,
                   "top": [{"layout": e.state.layout.short(), "strategy": e.state.strategy.short(),
                            "step_time_s": e.state.prediction.step_time_s} for e in res.result.ranked[:top]],
                   "rejected": dict(res.result.rejected), "search": search_dict(res.result), "plan": output}
        out.print_json(json.dumps(summary))
        return
    render_plan(out, res.plan, sources)
    if top > 1 or res.result.rejected:
        render_search(out, res.result, top)
    out.print(search_summary(res.result))
    out.print(f"compiled in {res.compile_s:.2f} s" + (f"; plan written to {output}" if output else ""))


@app.command("explore")
def explore_cmd(
    space_path: str = typer.Argument(..., metavar="SPACE", help="SPACE YAML: base model, choices, constraints"),
    target: str = typer.Option(..., "--target", help="target name (e.g. ascend-910b) or YAML"),
    devices: int = typer.Option(..., "--devices", help="number of devices"),
    verify: int = typer.Option(50, "--verify", help="compile the best K with the full pipeline (0: none)"),
    top: int = typer.Option(20, "--top", help="rows of the table"),
    out_dir: Optional[str] = typer.Option(None, "--out", help="folder for results.csv and pareto.png "
                                                              "(default: explore-<space name>)"),
    workers: Optional[int] = typer.Option(None, "--workers", help="worker processes (default: CPU count)"),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS", help=RAY_HELP),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary instead of the table"),
) -> None:
    """Search model architectures: screen every one of SPACE, verify the best with the full pipeline."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from moeplan.explore import Verified, explore, load_space
    from moeplan.files import write_atomic
    from moeplan.ray_pool import require as require_ray
    from moeplan.render_explore import explore_summary, pareto_png, render_explore, to_csv, verified_line
    from moeplan.targets import load_target

    for name, v in (("devices", devices), ("top", top), ("workers", workers)):
        positive(name, v)
    if verify < 0:
        raise LayoutError(f"verify={verify}: must be >= 0")
    space = load_space(space_path)
    require_ray(ray)
    read_model_warning(space.base)  # the base's ignored keys, before the long work
    tgt = load_target(target)
    folder = Path(out_dir or f"explore-{space.name}")
    if folder.exists() and not folder.is_dir():
        raise LayoutError(f"out={str(folder)!r}: exists and is not a folder")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True, disable=as_json) as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task("screening" if phase == "screen" else "verifying", total=total)
            bar.update(tasks[phase], completed=done)

        def verified(v: Verified, name: str) -> None:  # each as its compile finishes, above the bar
            if not as_json:
                bar.console.print(verified_line(v, name))

        result = explore(space, target=tgt, num_devices=devices, verify=verify, workers=workers, progress=progress,
                         ray=ray, verified=verified)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "results.csv", to_csv(result))
    write_atomic(folder / "pareto.png", pareto_png(result))
    if as_json:
        out.print_json(json.dumps(explore_summary(result, top) | {"csv": str(folder / "results.csv"),
                                                                   "png": str(folder / "pareto.png")}))
        return
    render_explore(out, result, top)
    out.print(f"wrote {folder / 'results.csv'} and {folder / 'pareto.png'}")


@app.command("describe")
def describe_cmd(model: str = typer.Argument(..., help="registry name, moeplan YAML or HF config.json"),
                 seq_len: Optional[int] = typer.Option(None, "--seq-len",
                                                       help="tokens per sequence (default: the model's)"),
                 as_json: bool = typer.Option(False, "--json", help="print the figures as JSON")) -> None:
    """Parameters, FLOPs per token and per-layer-kind costs of MODEL."""
    from moeplan.describe import describe_model
    from moeplan.render_describe import describe_json, render_describe

    positive("seq_len", seq_len)
    spec = read_model_warning(model).with_shape(seq_len=seq_len)
    d = describe_model(spec, seq_len=spec.seq_len)
    if as_json:
        out.print_json(json.dumps(describe_json(d)))
    else:
        render_describe(out, spec, d)


@app.command("simulate")
def simulate_cmd(plan_path: str = typer.Argument(..., metavar="PLAN", help="a plan YAML of `moeplan compile`"),
                 as_json: bool = typer.Option(False, "--json", help="print the figures as JSON")) -> None:
    """Re-simulate a saved plan's decisions with freshly computed costs."""
    from moeplan.plan import MFU_DEFINITION, load_plan
    from moeplan.replay import resimulate

    plan = load_plan(plan_path)
    p = resimulate(plan).prediction
    assert p is not None
    data = {"step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "hfu": p.hfu,
            "bubble": p.bubble, "peak_memory_bytes": list(p.peak_memory_bytes),
            "exposed_comm_s": dict(p.exposed_comm_s), "comm": {k: dict(v) for k, v in p.comm.items()},
            "saved_step_time_s": plan.prediction.step_time_s}
    if as_json:
        out.print_json(json.dumps(data))
        return
    out.print(f"step {p.step_time_s:.3f} s (plan says {plan.prediction.step_time_s:.3f} s) · "
              f"{p.tokens_per_s:,.0f} tokens/s · MFU {p.mfu:.1%} · bubble {p.bubble:.2%}")
    out.print(Text(MFU_DEFINITION, style="dim"))


@app.command("schema")
def schema_cmd() -> None:
    """Print the plan's JSON Schema."""
    from moeplan.plan import plan_json_schema

    sys.stdout.write(json.dumps(plan_json_schema(), indent=2) + "\n")


@app.command("run")
def run_cmd(
    ctx: typer.Context,
    plan_path: str = typer.Argument(..., metavar="PLAN", help="a plan YAML of `moeplan compile`"),
    steps: int = typer.Option(..., "--steps", help="training steps to run (in total, when resuming)"),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="write one JSON line per step here"),
    data: Optional[str] = typer.Option(None, "--data", help="text, .npy or .pt token file (default: stdlib sources)"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="checkpoint every K steps (0: never)"),
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir",
                                                 help="folder of the checkpoints (--checkpoint-every, --resume)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest complete checkpoint"),
    seed: int = typer.Option(0, "--seed", help="seed of the parameter initialisation"),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate"),
    timeout: float = typer.Option(60.0, "--timeout", help="collective timeout, seconds"),
    devices: Optional[int] = typer.Option(None, "--devices", help="refuse the plan unless it is for this many"),
    meter_every: Optional[int] = typer.Option(
        None, "--meter-every", help="measure saved activations and in-layer collectives every K steps, the first "
                                    "included (their hooks slow those steps; default: every step of a local cpu "
                                    f"run, every {PRODUCTION_METER_EVERY}th under torchrun)"),
    print_command: bool = typer.Option(False, "--print-command", help="print the torchrun command to run on every "
                                                                      "node instead of launching (cpu plans too)"),
    force_balanced_routing: bool = typer.Option(False, "--force-balanced-routing",
                                                help="benchmarking: route every token to random experts (balanced "
                                                     "routing, as the plan assumes); changes training"),
    no_pin: bool = typer.Option(False, "--no-pin", help="cpu plans: do not bind each rank to its own core (by "
                                                        "default rank i runs on the i-th CPU this process may use)"),
    rebalance_every: Optional[int] = typer.Option(
        None, "--rebalance-every", help="every N steps, re-place the routed experts by the load they saw and move "
                                        "them between expert ranks (0: never; default: the plan's "
                                        "experts.load.rebalance, else never; docs/runtime.md)"),
    rebalance_threshold: Optional[float] = typer.Option(
        None, "--rebalance-threshold", help="with --rebalance-every: apply a layer's new placement only when it "
                                            "lowers the predicted device imbalance (max/mean - 1) by more than "
                                            "this (default 0.05)"),
    aux_loss_coeff: float = typer.Option(0.0, "--aux-loss-coeff",
                                         help="weight of the MoE auxiliary load-balance loss (0: none)"),
    aux_loss_scope: Optional[str] = typer.Option(
        None, "--aux-loss-scope", help="the tokens the auxiliary loss balances over: sequence, micro-batch, "
                                       "ep-group, dp-group or global-batch (default micro-batch; docs/runtime.md)"),
    record_load: Optional[str] = typer.Option(None, "--record-load",
                                              help="write every step's routed tokens per expert and MoE layer to "
                                                   "this expert-load trace (docs/load-balance.md)"),
) -> None:
    """Train with PLAN: local processes for a cpu target, the torchrun command for cuda/npu (or run under it).

    Ctrl-C stops every rank and exits 130 with one line naming the checkpoint to --resume from (docs/runtime.md).
    """
    import os

    from moeplan.plan import load_plan
    from moeplan.runtime.data import BYTE_VOCAB, check_tokens, file_tokens
    from moeplan.runtime.checkpoint import checkpoint_lock
    from moeplan.runtime.launch import (RunFailed, RunInterrupted, check_runnable, launch_local, torchrun_command,
                                        under_torchrun)

    for name, v in (("steps", steps), ("devices", devices), ("meter_every", meter_every)):
        positive(name, v)
    plan = load_plan(plan_path)
    if meter_every is None:  # a production run (torchrun, cuda/npu) pays the meter's hooks on one step in 100
        production = print_command or under_torchrun() or plan.target.backend != "cpu"
        meter_every = PRODUCTION_METER_EVERY if production else 1
    planned = plan.experts.load.rebalance if plan.experts.load is not None else None
    if rebalance_every is None and planned is not None:  # the plan's (compile --rebalance-every); 0 overrides it
        rebalance_every = planned.every
        if rebalance_threshold is None:
            rebalance_threshold = planned.threshold
    request = run_request(plan_path, steps=steps, metrics=metrics, data=data, checkpoint_every=checkpoint_every,
                          checkpoint_dir=checkpoint_dir, resume=resume, seed=seed, lr=lr, timeout=timeout,
                          meter_every=meter_every, force_balanced_routing=force_balanced_routing, no_pin=no_pin,
                          rebalance_every=rebalance_every, rebalance_threshold=rebalance_threshold,
                          aux_loss_coeff=aux_loss_coeff, aux_loss_scope=aux_loss_scope, record_load=record_load)
    if devices is not None and devices != plan.layout.num_devices:
        raise PlanError(f"layout.num_devices={plan.layout.num_devices}: the plan is not for --devices {devices}")
    if request.rebalance_every:
        from moeplan.runtime.rebalance import check_rebalance

        check_rebalance(plan, request.rebalance_every)
    if request.aux_loss_coeff:
        from moeplan.runtime.expert_parallel import check_aux_loss

        check_aux_loss(plan, request.aux_loss_coeff, request.aux_loss_scope)
    if request.record_load and not plan.model.spec.is_moe:
        raise PlanError(f"record_load={record_load!r}: the model has no routed experts to count")
    if resume:  # refused here in one line, not by a traceback per rank (under torchrun too)
        from moeplan.runtime.checkpoint import newest_checkpoint, verify_checkpoint

        ref = newest_checkpoint(request.checkpoint_dir)
        if ref is not None:  # before any rank starts, and before torch reads a byte of it
            from moeplan.runtime.rebalance import initial_placements

            verify_checkpoint(ref, layout=plan.layout, model=plan.model.fingerprint,
                              placements=initial_placements(plan))
    if under_torchrun():
        from moeplan.runtime.worker import run_rank

        check_runnable(plan, world_size=int(os.environ["WORLD_SIZE"]))
        raise typer.Exit(run_rank(request))
    if print_command or plan.target.backend != "cpu":
        check_runnable(plan, need_backend=False)
        command = torchrun_command(plan, request)
        out.print(f"# {plan.target.backend}, {plan.layout.num_devices} devices: run on every node; MASTER_ADDR "
                  f"(and MASTER_PORT, default 29500) name the first node (default localhost)",
                  markup=False, highlight=False, soft_wrap=True)
        out.print(command, markup=False, highlight=False, soft_wrap=True)
        return
    check_runnable(plan)
    old_lines = request.metrics and not resume and os.path.isfile(request.metrics) and os.path.getsize(request.metrics)
    if old_lines:  # a fresh run would delete it: an earlier run's measurements are the user's
        raise PlanError(f"metrics={metrics!r}: holds an earlier run's lines, which a fresh run would delete; name "
                        f"another file, remove it, or --resume that run")
    old_trace = request.record_load and not resume and os.path.isfile(request.record_load) and os.path.getsize(
        request.record_load)
    if old_trace:  # the same rule: a fresh run would replace it
        raise PlanError(f"record_load={record_load!r}: holds an earlier run's trace, which a fresh run would replace; "
                        f"name another file, remove it, or --resume that run")
    if data is None and plan.model.spec.vocab_size < BYTE_VOCAB:
        raise PlanError(f"model.spec.vocab_size={plan.model.spec.vocab_size}: byte-level stdlib data needs "
                        f">= {BYTE_VOCAB}; pass --data")
    if data is not None:
        check_tokens(file_tokens(data), vocab_size=plan.model.spec.vocab_size, seq_len=plan.layout.seq_len)
    try:
        # the checkpoint folder is held by this launcher for the whole run (under torchrun: not checked)
        with checkpoint_lock(request.checkpoint_dir) if request.checkpoint_dir else contextlib.nullcontext():
            launch_local(plan, request)
    except RunInterrupted as e:
        err.print(f"moeplan run: {e}", markup=False)
        raise typer.Exit(e.exit_code)
    except RunFailed as e:
        if e.traceback and getattr(ctx.obj, "debug", False):  # moeplan --debug run: the failed rank's traceback
            err.print(e.traceback.rstrip(), markup=False, highlight=False)
        err.print(f"error: {e}", markup=False)
        raise typer.Exit(1)


@app.command("compare")
def compare_cmd(plan_path: str = typer.Argument(..., metavar="PLAN", help="the plan that was run"),
                metrics_path: str = typer.Argument(..., metavar="METRICS",
                                                   help="the JSONL file of `moeplan run --metrics`"),
                first_step: Optional[int] = typer.Option(None, "--first-step",
                                                         help="median over steps from this one on (default 5, or "
                                                              "every step after the first in a shorter run)"),
                as_json: bool = typer.Option(False, "--json", help="print the rows as JSON")) -> None:
    """Predicted (PLAN) vs measured (METRICS from `moeplan run`): step time, actions, comm, activations, then per
    comm class the bytes per link tier, exposed seconds and overlap rate; a warning on stderr when the machine was
    busy with other work during the measured steps."""
    from moeplan.plan import load_plan
    from moeplan.runtime.compare import (busy_warning, comm_class_rows, compare, measured_window, read_records,
                                         render_comm_classes, render_rows, rows_json, uncalibrated_warning)

    positive("first_step", first_step)
    plan = load_plan(plan_path)
    records = read_records(metrics_path)
    window = measured_window(records, first_step)
    rows = compare(plan, records, first_step=first_step)
    comm = comm_class_rows(plan, records, first_step=first_step)
    if as_json:
        out.print_json(json.dumps(rows_json(rows + comm)))
    else:
        render_rows(out, rows, title=f"{plan.model.name} · {plan.target.name} · predicted vs measured "
                                     f"(median of steps {window[0].step}..{window[-1].step})")
        render_comm_classes(out, comm, title="per comm class, per device and step")
    for warning in (busy_warning(records, first_step=first_step), uncalibrated_warning(plan, rows)):
        if warning:  # after the table, where it is read
            warn(warning)


@app.command("calibrate")
def calibrate_cmd(target: str = typer.Option("cpu", "--target", help="base target (a cpu target)"),
                  output: str = typer.Option(..., "-o", "--output", help="write the calibrated target YAML here"),
                  name: Optional[str] = typer.Option(None, "--name", help="target name (default: the file's stem)"),
                  fit_model: Optional[str] = typer.Option(None, "--fit-model",
                                                          help="scale the launch costs to a measured step of MODEL"),
                  rounds: int = typer.Option(15, "--rounds", help="rounds of the gloo measurement beside compute, "
                                             "whose median is kept (fewer: quicker, noisier)"),
                  as_json: bool = typer.Option(False, "--json", help="print the calibrated target as JSON")) -> None:
    """Measure this machine (matmul, elementwise, per-op overhead, gloo α–β) and write a calibrated cpu target."""
    from pathlib import Path

    from moeplan.calibrate import (calibrate, calibrated_target, fit_launch_scale, fit_summary, scaled_target,
                                   write_target)
    from moeplan.errors import TargetError
    from moeplan.files import check_output
    from moeplan.spec import load_spec
    from moeplan.targets import load_target

    positive("rounds", rounds)
    base = load_target(target)
    if base.backend != "cpu":
        raise TargetError(f"target={target!r}: calibrate measures this machine's CPU; choose a cpu target")
    spec = load_spec(fit_model) if fit_model else None
    check_output(output)  # before a minute of measuring
    cal = calibrate(rounds=rounds)
    tgt = calibrated_target(base, cal, name=name or Path(output).stem)
    fit = fit_launch_scale(spec, tgt) if spec is not None else None
    if fit is not None:
        tgt = scaled_target(tgt, fit.forward_scale, fit.backward_scale, fit.rate_scale)
        out.print(fit_summary(fit, fit_model or ""))
    write_target(tgt, cal, output, fit=fit, fit_model=fit_model or "")
    if as_json:
        out.print_json(json.dumps(tgt.model_dump(mode="json")))
        return
    out.print(f"matmul {cal.cube_flops / 1e9:.1f} GFLOP/s · add {cal.vector_flops / 1e9:.2f} GFLOP/s · "
              f"{cal.memory_bytes_per_s / 1e9:.1f} GB/s · launch {tgt.launch.matmul_s * 1e6:.1f}/"
              f"{tgt.launch.other_s * 1e6:.1f} us · gloo {tgt.intra_node.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
              f"α {tgt.intra_node.latency_s * 1e6:.0f} us · under load " + ", ".join(
                  f"{k} {v * 1e6:.0f} us" for k, v in sorted(tgt.launch.collective_latency_s.items()))
              + f" · comm_compute_slowdown {tgt.comm_compute_slowdown:.2f} (" + ", ".join(
                  f"{k} {v:.2f}" for k, v in tgt.comm_compute_slowdown_by_kind.items())
              + f") · p2p_host_s {tgt.launch.p2p_host_s * 1e6:.0f} us")
    out.print(f"calibrated target written to {output}")


@app.command("diff")
def diff_cmd(plan_a: str = typer.Argument(..., metavar="A", help="the plan YAML to compare against"),
             plan_b: str = typer.Argument(..., metavar="B", help="the plan YAML whose differences are shown"),
             summary: bool = typer.Option(False, "--summary", help="the prediction, then one line per other "
                                                                    "section: how many of its rows differ"),
             as_json: bool = typer.Option(False, "--json", help="print the differences as JSON")) -> None:
    """Differences of plan B from plan A: the prediction first, then model, layout, stages, memory, schedule and
    comm."""
    from moeplan.diff import diff_json, diff_plans, load_side, render_diff

    d = diff_plans(load_side(plan_a, "A"), load_side(plan_b, "B"), label_a=plan_a, label_b=plan_b)
    if as_json:
        out.print_json(json.dumps(diff_json(d)))
        return
    render_diff(out, d, summary=summary)


@app.command("inspect")
def inspect_cmd(plan_path: str = typer.Argument(..., metavar="PLAN", help="a plan YAML of `moeplan compile`"),
                static: bool = typer.Option(False, "--static", help="print every view as tables (implied when stdout "
                                                                     "is not a terminal)")) -> None:
    """Browse PLAN in the terminal: overview, stages, memory, timeline, comm (docs/inspect.md)."""
    from moeplan.plan import load_plan
    from moeplan.views import print_static

    plan = load_plan(plan_path)
    if static or not sys.stdout.isatty():
        print_static(StdoutConsole(width=VIEW_PIPE_WIDTH) if out.width == PIPE_WIDTH else out, plan)
        return
    from moeplan.tui import InspectApp

    InspectApp(plan).run()


@app.command("timeline")
def timeline_cmd(plan_path: str = typer.Argument(..., metavar="PLAN", help="a plan YAML of `moeplan compile`"),
                 output: str = typer.Option(..., "-o", "--output", help="write the Chrome / Perfetto trace JSON here"),
                 png: Optional[str] = typer.Option(None, "--png", help="also draw the Gantt and memory PNG here")
                 ) -> None:
    """Write PLAN's simulated step as a trace for ui.perfetto.dev or chrome://tracing (docs/timeline.md)."""
    from moeplan.files import check_output
    from moeplan.gantt import write_timeline
    from moeplan.plan import load_plan

    check_output(output)  # both before either is written: every output or none
    if png:
        check_output(png, field="png")
    st = write_timeline(load_plan(plan_path), output, png)
    out.print(f"{len(st.slices):,} events on {sum(map(len, st.tracks))} tracks of {len(st.tracks)} PP ranks, step "
              f"{st.step_s * 1e3:,.3f} ms: {output}" + (f"; Gantt: {png}" if png else ""), soft_wrap=True)


@app.command("export")
def export_cmd(plan_path: str = typer.Argument(..., metavar="PLAN", help="a plan YAML of `moeplan compile`"),
               to: str = typer.Option(..., "--to", help="megatron|mindspeed-llm|torchtitan|torch-pipelining"),
               output: Optional[str] = typer.Option(None, "-o", "--output", help="write here (default: stdout)")
               ) -> None:
    """PLAN as another runtime's launch config: Megatron-LM / MindSpeed-LLM flags, a torchtitan TOML, or the
    torch.distributed.pipelining schedule CSV; what the runtime cannot express is listed as # lines (docs/export.md)."""
    from moeplan.export import export_file
    from moeplan.files import write_atomic

    ex = export_file(plan_path, to)
    if output is None:
        sys.stdout.write(ex.document())
    else:
        write_atomic(output, ex.document())  # OutputError (exit 2) when it cannot
    if not ex.commented:  # the CSV has no comment syntax: its notes go to stderr
        for n in ex.notes:
            err.print(f"# {n}", markup=False)


@app.command("models")
def models_cmd(as_json: bool = typer.Option(False, "--json", help="print the rows as JSON")) -> None:
    """The models known by name (examples/models/registry.yaml), with their default training shape."""
    from moeplan.render import models_rows, render_models

    rows = models_rows()
    if as_json:
        out.print_json(json.dumps(rows))
        return
    render_models(out, rows)


@app.command("targets")
def targets_cmd(as_json: bool = typer.Option(False, "--json", help="print the rows as JSON")) -> None:
    """The shipped hardware targets and their variants (targets/*.yaml): memory, peak, link bandwidths."""
    from moeplan.render import render_targets, targets_rows

    rows = targets_rows()
    if as_json:
        out.print_json(json.dumps(rows))
        return
    render_targets(out, rows)


def _print_version(value: bool) -> None:
    if value:
        from moeplan import __version__

        out.print(f"moeplan {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _options(ctx: typer.Context,
             version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="print moeplan's version and exit"),
             debug: bool = typer.Option(False, "--debug", help="on an internal error (a bug, exit 1), print its "
                                                               "traceback")) -> None:
    """Options before the command (``moeplan --version``, ``moeplan --debug compile ...``); what the error report
    needs of them goes in the click context (moeplan.cli_errors.GuardedGroup reads it)."""
    ctx.obj = Invocation(debug=debug, command=ctx.invoked_subcommand)


def main() -> None:
    """Entry point: run the app; an error ends it with one line on stderr and exit 2 (bad input), 3 (infeasible) or
    1 (a bug, named as an internal error of the command; ``moeplan --debug COMMAND`` prints the traceback too).
    Usage errors (unknown option, missing argument) are typer's own: usage text and exit 2 (moeplan.cli_errors).
    """
    # at exit, freeze what is left so the interpreter's last collection does not traverse torch's objects and the
    # compiled plan one by one (0.5-1 s of a compile's wall time on a 2-core machine)
    atexit.register(gc.freeze)
    keep_swallowed_interrupts()  # already done by the console script (moeplan.entry); not by python -m moeplan.cli
    try:
        app()
    except BrokenPipeError:
        exit_on_broken_pipe()
    except KeyboardInterrupt:  # outside any command (before typer parses the arguments)
        exit_on_interrupt()
    except Exception as e:
        exit_on_error(e, invocation_of(e))


if __name__ == "__main__":
    main()
