"""The ``moeplan`` command line: compile, describe, simulate, schema.

Errors in user input exit 2 and a plan that cannot fit exits 3, each with one line on stderr and no traceback
(DESIGN §8.7); output files are written atomically.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console

from moeplan.errors import InfeasibleError, LayoutError, MoeplanError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Compile MoE training jobs into execution plans.")
out = Console()
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _positive(name: str, value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise LayoutError(f"{name}={value}: must be a positive integer")
    return value


@app.command("compile")
def compile_cmd(
    model: str = typer.Argument(..., help="registry name, moeplan YAML or HF config.json"),
    target: str = typer.Option(..., "--target", help="target name (e.g. ascend-910b, ascend-910b:313t) or YAML"),
    devices: int = typer.Option(..., "--devices", help="number of devices"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="write the plan YAML here"),
    devices_per_node: Optional[int] = typer.Option(None, "--devices-per-node"),
    tp: Optional[int] = typer.Option(None, "--tp"), pp: Optional[int] = typer.Option(None, "--pp"),
    vpp: Optional[int] = typer.Option(None, "--vpp"), ep: Optional[int] = typer.Option(None, "--ep"),
    etp: Optional[int] = typer.Option(None, "--etp"), cp: Optional[int] = typer.Option(None, "--cp"),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch"),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", help="sequences per step"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len"),
    pipeline: Optional[str] = typer.Option(None, "--pipeline", help="comma-separated pass names"),
    top: int = typer.Option(1, "--top", help="print the best K layouts"),
    candidates: int = typer.Option(16, "--candidates", help="layouts simulated with the full pipeline"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary instead of tables"),
) -> None:
    """Compile MODEL for DEVICES devices of TARGET into a plan."""
    from moeplan.compile import compile_model
    from moeplan.compiler import DEFAULT_PIPELINE
    from moeplan.plan import save_plan
    from moeplan.render import layout_dict, predicted_dict, render_plan, render_search
    from moeplan.search import Fixed
    from moeplan.spec import load_spec
    from moeplan.targets import load_target

    for name, v in (("devices", devices), ("devices_per_node", devices_per_node), ("tp", tp), ("pp", pp),
                    ("vpp", vpp), ("ep", ep), ("etp", etp), ("cp", cp), ("micro_batch", micro_batch),
                    ("global_batch", global_batch), ("seq_len", seq_len), ("top", top),
                    ("candidates", candidates)):
        _positive(name, v)
    spec = load_spec(model).with_shape(seq_len=seq_len, global_batch=global_batch)
    tgt = load_target(target, devices_per_node=devices_per_node)
    fixed = Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp,
                  cp=cp, micro_batch=micro_batch)
    res = compile_model(spec=spec, target=tgt, num_devices=devices, fixed=fixed,
                        pipeline=pipeline or DEFAULT_PIPELINE, candidates=candidates)
    if output:
        save_plan(res.plan, output)
    if as_json:
        summary = {"layout": layout_dict(res.plan), "predicted": predicted_dict(res.plan),
                   "compile_s": res.compile_s, "stages": res.plan.stages.chunks,
                   "imbalance": res.plan.stages.imbalance, "stages_reason": res.plan.stages.reason,
                   "top": [{"layout": e.state.layout.short(), "step_time_s": e.state.prediction.step_time_s}
                           for e in res.result.ranked[:top]],
                   "rejected": dict(res.result.rejected), "plan": output}
        out.print_json(json.dumps(summary))
        return
    render_plan(out, res.plan)
    if top > 1 or res.result.rejected:
        render_search(out, res.result, top)
    out.print(f"compiled in {res.compile_s:.2f} s" + (f"; plan written to {output}" if output else ""))


@app.command("describe")
def describe_cmd(model: str = typer.Argument(...), seq_len: Optional[int] = typer.Option(None, "--seq-len"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Parameters, FLOPs per token and per-layer-kind costs of MODEL."""
    from moeplan.describe import describe_model
    from moeplan.render_describe import describe_json, render_describe
    from moeplan.spec import load_spec

    _positive("seq_len", seq_len)
    spec = load_spec(model).with_shape(seq_len=seq_len)
    d = describe_model(spec, seq_len=spec.seq_len)
    if as_json:
        out.print_json(json.dumps(describe_json(d)))
    else:
        render_describe(out, spec, d)


@app.command("simulate")
def simulate_cmd(plan_path: str = typer.Argument(..., metavar="PLAN"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Re-simulate a saved plan's decisions with freshly computed costs."""
    from moeplan.compile import resimulate
    from moeplan.plan import MFU_DEFINITION, load_plan

    plan = load_plan(plan_path)
    p = resimulate(plan).prediction
    assert p is not None
    data = {"step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "hfu": p.hfu,
            "bubble": p.bubble, "peak_memory_bytes": list(p.peak_memory_bytes),
            "exposed_comm_s": dict(p.exposed_comm_s), "saved_step_time_s": plan.prediction.step_time_s}
    if as_json:
        out.print_json(json.dumps(data))
        return
    out.print(f"step {p.step_time_s:.3f} s (plan says {plan.prediction.step_time_s:.3f} s) · "
              f"{p.tokens_per_s:,.0f} tokens/s · MFU {p.mfu:.1%} · bubble {p.bubble:.2%}")
    out.print(f"[dim]{MFU_DEFINITION}[/]")


@app.command("schema")
def schema_cmd() -> None:
    """Print the plan's JSON Schema."""
    from moeplan.plan import plan_json_schema

    sys.stdout.write(json.dumps(plan_json_schema(), indent=2) + "\n")


def main() -> None:
    """Entry point: run the app, mapping moeplan's errors to one line and exit 2 (bad input) or 3 (infeasible).

    Usage errors (unknown option, missing argument) are typer's own: usage text and exit 2.
    """
    try:
        app()
    except InfeasibleError as e:
        err.print(f"error: {e}", markup=False)
        sys.exit(3)
    except MoeplanError as e:
        if not isinstance(e, ValueError):  # an internal failure (PassFailed): keep the traceback
            raise
        err.print(f"error: {e}", markup=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
