"""Predicted vs measured step time of published MoE training runs (and the dense Megatron-LM control runs).

Reads ``benchmarks/published_runs.yaml`` (each run's model, hardware, layout, schedule, dispatcher, overlap,
recompute, dtype and measured figure, with its source), turns every measured figure into seconds per step with the
source's own FLOP formula (``benchmarks/flop_formulas.py``), compiles the run's layout with moeplan — every degree
and choice the source states is fixed; what it does not state is listed per run as an assumption — and prints per
run the predicted and measured step, the error and moeplan's breakdown; per group of layouts of one model on the same
hardware, the predicted and the measured order; and the summary (median and worst absolute error).

Layers are split over the pipeline as the runs' frameworks split them: the same number of decoder layers in every
virtual stage (Megatron-LM ``get_num_layers_to_build``, torchtitan's even split points), padded with empty layers
(``partition-stages{layer_layout=uniform}``); where the count cannot be spread evenly, moeplan's own split, noted.

The memory plan is not enforced here (``plan-memory{enforce=false}``), so that every run's step is priced; the
table marks a run whose memory exceeds the device, and ``benchmarks/published_memory.py`` enforces it.

The runs are independent: they are predicted in ``--jobs`` processes (default: one per CPU), the table in the
YAML's order whatever the count.

Usage: ``python benchmarks/published_runs.py [--json] [--only ID_SUBSTRING] [--dense] [--jobs N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flop_formulas import FORMULAS  # noqa: E402

from moeplan.compiler import run_pipeline  # noqa: E402
from moeplan.compiler import Pipeline  # noqa: E402
from moeplan.errors import LayoutError  # noqa: E402
from moeplan.layout import Layout  # noqa: E402
from moeplan.ir import named_layers  # noqa: E402
from moeplan.search import Fixed, check, strategies  # noqa: E402
from moeplan.spec import ModelSpec, load_spec  # noqa: E402
from moeplan.cost_models.saved_tensors import MODULE_ALIASES  # noqa: E402
from moeplan.state import PlanState, Precision, Strategy  # noqa: E402
from moeplan.targets import load_target  # noqa: E402
from moeplan.trace import trace_model  # noqa: E402

PIPELINE = "shard,partition-stages,place-experts,schedule,plan-memory{enforce=false},simulate"
HERE = Path(__file__).resolve().parent
PEAKS = {"h100": 989.5e12, "h800": 989.5e12, "h200": 989.5e12, "a100": 312e12}


@dataclass(frozen=True)
class Result:
    id: str
    group: str | None
    measured_s: float
    predicted_s: float
    assumptions: tuple[str, ...]
    breakdown: dict
    config_source: str = ""

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def measured_step_s(run: dict, spec: ModelSpec) -> float:
    """The run's measured figure as seconds per step (module docstring)."""
    m, lay = run["measured"], run["layout"]
    tokens = lay["global_batch"] * lay["seq_len"]
    if m["metric"] == "step_time_s":
        return m["value"]
    if m["metric"] == "tokens_per_s_per_gpu":
        return tokens / (m["value"] * run["devices"])
    if m["metric"] == "tokens_per_s":
        return tokens / m["value"]
    formula = FORMULAS[m["flop_formula"]]
    kwargs = {"tp": lay["tp"]} if "tp" in formula.__code__.co_varnames else {}
    flops = formula(spec, seq_len=lay["seq_len"], **kwargs) * tokens
    if m["metric"] == "tflops_per_gpu":
        return flops / (m["value"] * 1e12 * run["devices"])
    return flops / (m["value"] * m.get("peak_flops", PEAKS[run["target"]]) * run["devices"])


def _layout(run: dict, notes: list[str]) -> Layout:
    lay = dict(run["layout"])
    if lay.get("micro_batch") is None:
        lay["micro_batch"] = 1
        notes.append("micro_batch 1 (not stated; Megatron-LM's MoE example uses --micro-batch-size 1)")
    if lay.get("vpp") is None:
        lay["vpp"] = 2 if run.get("schedule") in ("zbv", "dualpipev") else 1
    devices = run["devices"]
    dp = devices // (lay["tp"] * lay["cp"] * lay["pp"])
    # Megatron-LM's EP is the number of expert shards (ranks holding different experts); moeplan's ep counts the
    # DP×CP ranks the expert group takes, expert_shards = ep·tp/etp (moeplan/layout.py)
    ep = lay["ep"] * lay["etp"] // lay["tp"]
    return Layout(tp=lay["tp"], pp=lay["pp"], vpp=lay["vpp"], ep=ep, etp=lay["etp"], cp=lay["cp"], dp=dp,
                  micro_batch=lay["micro_batch"], global_batch=lay["global_batch"], seq_len=lay["seq_len"],
                  dp_shard=lay.get("dp_shard") or 1)


def _strategy(run: dict, layout: Layout, graph, target, notes: list[str]) -> Strategy:
    schedule = run.get("schedule") or ("interleaved" if layout.vpp > 1 else "1f1b")
    if run.get("schedule") is None:
        notes.append(f"schedule {schedule} (not stated)")
    overlap = run.get("overlap")
    if overlap is None:  # Megatron-LM's MoE example (examples/mixtral/train_mixtral_8x7b_distributed.sh @0a40979)
        overlap = ["dp"] + (["pp"] if schedule == "interleaved" else [])  # runs --overlap-grad-reduce
        notes.append(f"overlap {', '.join(overlap)} (not stated: Megatron-LM's MoE example overlaps the "  # and
                     "distributed optimizer's collectives; p2p overlaps under interleaving by default)")  # -param-gather
    rec, modules = recompute_of(run, notes)
    fixed = Fixed(global_batch=layout.global_batch, seq_len=layout.seq_len, schedule=schedule,
                  dispatcher=run.get("dispatcher") or None, overlap=frozenset(overlap), recompute=rec,
                  recompute_modules=modules, precision=precision_of(run, notes))
    options = strategies(layout, graph=graph, target=target, fixed=fixed).found
    if not options:
        raise SystemExit(f"{run['id']}: schedule {schedule} does not fit the layout")
    return options[0]


def recompute_of(run: dict, notes: list[str]) -> tuple[str, tuple[str, ...]]:
    """(moeplan recompute mode, Megatron-LM module names) of the run: its recipe's ``recompute_granularity`` and
    ``recompute_modules`` (read off the recipe at its commit), else its ``recompute`` field. ``selective`` with
    modules is ``modules:…``; without them it is Megatron-LM's default ``--recompute-modules core_attn``, except in
    a torchtitan recipe, whose selective AC without modules is its op-level policy (keeps matmul and attention
    outputs, re-runs the rest), priced as moeplan's ``selective``, the nearest whole-layer policy."""
    recipe = run.get("recipe") or {}
    given = run.get("recompute")
    if "recompute_granularity" in recipe:
        given = {"mode": recipe["recompute_granularity"] or "none", "modules": recipe.get("recompute_modules")}
    if given is None:
        notes.append("no recompute (not stated)")
        return "none", ()
    mode = given.get("mode") or "none"
    if mode != "selective":
        return mode, ()
    if given.get("modules"):
        return "modules", tuple(sorted({MODULE_ALIASES.get(m, m) for m in given["modules"]}))
    if "torchtitan" in (recipe.get("recipe_source") or ""):
        notes.append("recompute: torchtitan's op-level selective AC priced as moeplan's 'selective' (nearest)")
        return "selective", ()
    notes.append("recompute modules: core_attn (Megatron-LM's default --recompute-modules)")
    return "modules", ("core_attn",)


def precision_of(run: dict, notes: list[str]) -> Precision:
    """The run's model-state precision from its ``recipe`` block (each field as the recipe states it; Megatron-LM's
    defaults — fp32 gradients and master weights, fp32 moments, the distributed optimizer — where it is silent).
    ``fp8.activation_input_store``: the SwiGLU's input kept in FP8 (Megatron-LM
    ``TransformerConfig.activation_func_fp8_input_store``; DeepSeek-V3 §3.3.3 states it)."""
    recipe = run.get("recipe") or {}
    if not recipe:
        notes.append("precision: Megatron-LM's defaults (no recipe block)")
    main = recipe.get("main_params_dtype")
    if main is None and recipe.get("fsdp"):  # FSDP2 keeps no separate master copy: the shards are the weights, in
        main = recipe.get("grad_dtype")  # the dtype of their gradients (it casts the reduced gradient to it)
    fields = {"grad_dtype": recipe.get("grad_dtype"), "main_params_dtype": main,
              "moments_dtype": recipe.get("moments_dtype"),
              "distributed_optimizer": recipe.get("distributed_optimizer"),
              "fp8_activation_input": (recipe.get("fp8") or {}).get("activation_input_store")}
    return Precision(**{k: v for k, v in fields.items() if v is not None})


def compile_run(run: dict, pipeline: str, notes: list[str]) -> PlanState:
    """The run's layout, schedule and recipe through ``pipeline`` (module docstring); what it assumes is appended to
    ``notes``. Raises InfeasibleError when ``pipeline`` enforces memory and the run does not fit."""
    spec = load_spec(run["model"]).with_shape(seq_len=run["layout"]["seq_len"],
                                              global_batch=run["layout"]["global_batch"])
    if run.get("spec_overrides"):
        spec = ModelSpec.model_validate({**spec.model_dump(), **run["spec_overrides"]})
        notes.append(f"model {run['spec_overrides']}")
    target = load_target(run["target"], devices_per_node=run.get("devices_per_node"),
                         training_dtype=run.get("dtype") or None)
    layout = _layout(run, notes)
    graph = trace_model(spec, seq_len=layout.seq_len)
    check(layout, graph=graph, num_devices=run["devices"], devices_per_node=target.devices_per_node,
          num_slots=len(named_layers(spec)))
    strategy = _strategy(run, layout, graph, target, notes)
    start = PlanState(graph=graph, target=target, layout=layout, strategy=strategy)
    try:
        return run_pipeline(start, Pipeline.parse(pipeline).with_option("partition-stages", "layer_layout",
                                                                          "uniform").passes)[0]
    except LayoutError as e:
        notes.append(f"layer split: moeplan's ({e})")
        return run_pipeline(start, Pipeline.parse(pipeline).passes)[0]


def predict(run: dict) -> Result:
    notes: list[str] = list(run.get("moeplan_notes") or [])
    state = compile_run(run, PIPELINE, notes)
    spec, strategy = state.graph.spec, state.strategy
    p = state.prediction
    assert p is not None and state.memory is not None
    fits = all(m.total_bytes <= state.memory.budget_bytes for m in state.memory.stages)
    breakdown = {
        "strategy": strategy.short(), "mfu": p.mfu, "bubble": p.bubble, "host_wait_s": p.host_wait_s,
        "optimizer_s": p.optimizer_s, "memory_fits": fits,
        "peak_memory_gib": max(m.total_bytes for m in state.memory.stages) / 2**30,
        "comm": {c: {"total_s": v["total_s"], "exposed_s": v["exposed_s"], "steady_overlap_rate":
                     v["steady_overlap_rate"]} for c, v in p.comm.items() if v["total_s"]}}
    source = (run.get("config_source") or "").split(":", 1)[0]  # the repository and commit; the YAML has the rest
    return Result(run["id"], run.get("group"), measured_step_s(run, spec), p.step_time_s, tuple(notes), breakdown,
                  source)


def dense_runs() -> list[dict]:
    """Megatron-LM GPT runs on A100 (SC'21 Table 1, fp16, full recompute; arXiv 2205.05198 Table, SP + selective
    and full recompute), expressed as runs: a GPT block is MHA with ``8h/3``-wide SwiGLU (the same FLOPs and
    parameters as a 4h GeLU MLP), vocabulary 51,200, sequence 2048."""
    out = []
    for label, heads, hidden, layers, tp, pp, vpp, mbs, gbs, gpus, kind, value, rec in (
            ("1.7b", 24, 2304, 24, 1, 1, 1, 16, 512, 32, "tflops", 137, "full"),
            ("7.5b", 32, 4096, 36, 4, 1, 1, 16, 512, 128, "tflops", 142, "full"),
            ("39.1b", 64, 8192, 48, 8, 2, 1, 4, 1536, 512, "tflops", 138, "full"),
            ("145.6b", 96, 12288, 80, 8, 8, 2, 2, 2304, 1536, "tflops", 148, "full"),
            ("22b-sel", 64, 6144, 48, 8, 1, 1, 4, 4, 8, "s", 1.10, "selective"),
            ("175b-sel", 96, 12288, 96, 8, 8, 1, 1, 64, 64, "s", 13.75, "selective"),
            ("530b-sel", 128, 20480, 105, 8, 35, 1, 1, 280, 280, "s", 37.83, "selective"),
            ("1t-sel", 160, 25600, 128, 8, 64, 1, 1, 512, 512, "s", 71.49, "selective"),
            ("22b-full", 64, 6144, 48, 8, 1, 1, 4, 4, 8, "s", 1.42, "full"),
            ("175b-full", 96, 12288, 96, 8, 8, 1, 1, 64, 64, "s", 18.13, "full"),
            ("530b-full", 128, 20480, 105, 8, 35, 1, 1, 280, 280, "s", 49.05, "full"),
            ("1t-full", 160, 25600, 128, 8, 64, 1, 1, 512, 512, "s", 94.42, "full")):
        out.append({"id": f"gpt-{label}", "group": None, "spec": ModelSpec(
            name=f"gpt-{label}", vocab_size=51200, hidden_size=hidden, num_layers=layers, num_dense_layers=layers,
            dense_ffn_size=round(8 * hidden / 3), attention="gqa", num_heads=heads, num_kv_heads=heads,
            head_dim=hidden // heads, seq_len=2048, global_batch=gbs),
            "target": "a100", "devices": gpus, "dtype": "bf16", "schedule": None, "dispatcher": None,
            "overlap": [], "recompute": {"mode": rec},
            "layout": {"tp": tp, "pp": pp, "vpp": vpp, "ep": 1, "etp": tp, "cp": 1, "micro_batch": mbs,
                       "global_batch": gbs, "seq_len": 2048},
            "measured": {"kind": kind, "value": value, "layers": layers, "hidden": hidden}})
    return out


def predict_dense(run: dict) -> Result:
    m, lay = run["measured"], run["layout"]
    if m["kind"] == "tflops":  # SC'21 eq. (3): 96·B·s·l·h²(1 + s/6h + V/16lh), full recompute counted
        b, s, l, h = lay["global_batch"], 2048, m["layers"], m["hidden"]
        measured = 96 * b * s * l * h * h * (1 + s / (6 * h) + 51200 / (16 * l * h)) / (m["value"] * 1e12 * run["devices"])
    else:
        measured = m["value"]
    spec, target = run["spec"], load_target("a100")
    notes: list[str] = []
    layout = _layout(run, notes)
    graph = trace_model(spec, seq_len=2048)
    strategy = _strategy(run, layout, graph, target, [])
    state, _ = run_pipeline(PlanState(graph=graph, target=target, layout=layout, strategy=strategy),
                            Pipeline.parse(PIPELINE).passes)
    p = state.prediction
    assert p is not None
    return Result(run["id"], None, measured, p.step_time_s, (), {"strategy": strategy.short(), "mfu": p.mfu})


def _order(results: list[Result], attr: str) -> list[str]:
    return [r.id for r in sorted(results, key=lambda r: getattr(r, attr))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--dense", action="store_true", help="the dense Megatron-LM control runs instead")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes predicting runs (default: CPUs)")
    args = ap.parse_args()
    if args.jobs < 1:
        sys.exit(f"--jobs={args.jobs}: must be at least 1")
    t0 = time.perf_counter()
    if args.dense:
        fn, runs = predict_dense, [r for r in dense_runs() if args.only in r["id"]]
    else:
        runs = [r for r in yaml.safe_load((HERE / "published_runs.yaml").read_text())["runs"] if args.only in r["id"]]
        for r in runs:
            if r.get("exclude"):
                print(f"excluded {r['id']}: {r['exclude']}")
        fn, runs = predict, [r for r in runs if not r.get("exclude")]
    if args.jobs == 1:
        results = [fn(r) for r in runs]
    else:
        with ProcessPoolExecutor(max_workers=min(args.jobs, max(len(runs), 1))) as pool:
            results = list(pool.map(fn, runs))
    groups: dict[str, list[Result]] = {}
    for r in results:
        if r.group:
            groups.setdefault(r.group, []).append(r)
    errors = [abs(r.error) for r in results]
    summary = {"runs": len(results), "median_abs_error": statistics.median(errors) if errors else None,
               "max_abs_error": max(errors) if errors else None,
               "groups_in_order": {g: _order(rs, "predicted_s") == _order(rs, "measured_s") for g, rs in groups.items()},
               "seconds": time.perf_counter() - t0}
    if args.json:
        print(json.dumps({"results": [r.__dict__ | {"error": r.error} for r in results], "summary": summary},
                         default=str, indent=1))
        return
    for r in results:
        print(f"{r.id:50s} measured {r.measured_s:8.3f} s  predicted {r.predicted_s:8.3f} s  error {r.error:+6.1%}  "
              f"[{r.breakdown.get('strategy')}]")
        b = r.breakdown
        if "comm" in b:
            comm = ", ".join(f"{c} {v['exposed_s']:.2f}/{v['total_s']:.2f}s" for c, v in b["comm"].items())
            print(f"{'':50s} MFU {b['mfu']:.1%} bubble {b['bubble']:.1%} host {b['host_wait_s']:.2f}s "
                  f"opt {b['optimizer_s']:.2f}s mem {b['peak_memory_gib']:.0f} GiB{'' if b['memory_fits'] else ' (!)'}"
                  f"  exposed/total: {comm}")
        if r.config_source:
            print(f"{'':50s} config: {r.config_source}")
        for n in r.assumptions:
            print(f"{'':50s} assumed: {n}")
    for g, rs in groups.items():
        print(f"group {g}: measured order {_order(rs, 'measured_s')}")
        print(f"{'':6s}{' ' * len(g)}  predicted order {_order(rs, 'predicted_s')}  "
              f"{'SAME' if summary['groups_in_order'][g] else 'DIFFERENT'}")
    if not results:
        print("no runs selected")
        return
    print(f"{summary['runs']} runs: median |error| {summary['median_abs_error']:.1%}, max |error| "
          f"{summary['max_abs_error']:.1%}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
