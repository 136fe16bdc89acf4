"""``moeplan export``: the flags are real (tests/fixtures/, extracted from the runtimes' sources), the values come
from the plan, torch reads the schedule CSV back as the plan's actions, torchtitan's TOML holds the plan's
degrees, and bad input exits 2 with one line."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining.schedules import _Action, _add_reduce_grad, _PipelineScheduleRuntime

from moeplan.actions import compute_parts
from moeplan.cli import main
from moeplan.compile import compile_model
from moeplan.compiler import DEFAULT_PIPELINE, with_option
from moeplan.errors import PlanError
from moeplan.export import TARGETS, export_file, export_plan, pipeline_stages
from moeplan.plan import SCHEMA_VERSION, save_plan
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.state import Precision
from moeplan.targets import load_target

FIXTURES = Path(__file__).parent / "fixtures"


def _listed(name: str) -> set[str]:
    return {line.strip() for line in (FIXTURES / name).read_text().splitlines() if line and not line.startswith("#")}


FLAGS = {"megatron": _listed("megatron_lm_args.txt"), "mindspeed-llm": _listed("mindspeed_llm_args.txt")}
TORCHTITAN_KEYS = _listed("torchtitan_job_config_keys.txt")


def _tiny(target: str = "cpu", devices: int = 4, pipeline: str = DEFAULT_PIPELINE, **fixed):
    return compile_model(spec=load_spec("tiny-pangu"), target=load_target(target), num_devices=devices, workers=1,
                         pipeline=pipeline, fixed=Fixed(global_batch=fixed.pop("global_batch", 8), seq_len=64,
                                                        **fixed)).plan


@pytest.fixture(scope="module")
def plans():
    """Small plans that reach every branch of the exporters: VPP with empty and MTP layers (uneven decoder counts),
    a free split (num-layer-list), whole-layer selective and the two per-tensor recompute modes, and DualPipeV with
    fb / dedup / tp-extend-ep on a cuda target."""
    return {
        "pp2vpp2": _tiny(pp=2, vpp=2, schedule="interleaved"),
        "free-pp4": _tiny(pp=4, vpp=1, pipeline=with_option(DEFAULT_PIPELINE, "partition-stages", "layer_layout",
                                                               "free")),
        "ilp": _tiny(pp=2, vpp=1, recompute="ilp",
                     pipeline=with_option(DEFAULT_PIPELINE, "plan-memory", "budget_gib", 0.003)),
        "mindspeed": _tiny(pp=2, vpp=1, recompute="mindspeed"),
        "selective": _tiny(pp=2, vpp=1, recompute="selective"),
        "dualpipev": _tiny("h800", 16, global_batch=32, pp=2, vpp=2, tp=2, ep=4, etp=1, schedule="dualpipev",
                           dispatcher="dedup", overlap=frozenset({"fb", "dp", "pp", "shared-expert"})),
        "fsdp": _tiny("h100", 8, global_batch=16, pp=1, tp=1, cp=1, ep=2, etp=1, micro_batch=2, dp_shard=8),
        "recipe": _tiny("h800", 8, global_batch=16, pp=2, tp=1, cp=1, ep=2, etp=1, micro_batch=1,
                        recompute="modules", recompute_modules=("layernorm", "mla_up_proj", "moe_act"),
                        precision=Precision(grad_dtype="bf16", moments_dtype="bf16", fp8_activation_input=True)),
    }


def _args(text: str) -> dict[str, list[str]]:
    """The emitted argument lines as flag → values; every flag once."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        flag, *values = line.rstrip(" \\").split()
        assert flag not in out, f"{flag} emitted twice"
        out[flag] = [v.strip("'") for v in values]
    return out


def _check_real_flags(plan, target):
    ex = export_plan(plan, target)
    args = _args(ex.document())
    assert args, "no flags"
    unknown = sorted(set(args) - FLAGS[target])
    assert not unknown, f"{target} has no {unknown}"
    return ex, args


@pytest.mark.parametrize("target", ["megatron", "mindspeed-llm"])
@pytest.mark.parametrize("name", ["pp2vpp2", "free-pp4", "ilp", "mindspeed", "selective", "dualpipev", "fsdp",
                                  "recipe"])
def test_every_flag_is_in_the_runtime_parser(plans, name, target):
    _check_real_flags(plans[name], target)


def test_fsdp_and_the_recipe_are_exported_with_their_flags(plans):
    """FSDP: Megatron-FSDP's flags, refused by MindSpeed-LLM with a note, torchtitan's shard degree; the recipe's
    precision and Megatron-LM recompute modules with their own flags (MindSpeed-LLM's where it has them)."""
    fsdp = _args(export_plan(plans["fsdp"], "megatron").document())
    assert fsdp["--data-parallel-sharding-strategy"] == ["optim_grads_params"] and "--use-megatron-fsdp" in fsdp
    assert "--use-distributed-optimizer" not in fsdp
    ms = export_plan(plans["fsdp"], "mindspeed-llm")
    assert "--data-parallel-sharding-strategy" not in _args(ms.document())
    assert any("layout.dp_shard=8" in n for n in ms.notes)
    par = tomllib.loads(export_plan(plans["fsdp"], "torchtitan").document())["parallelism"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (8, 1)
    meg = _args(export_plan(plans["recipe"], "megatron").document())
    assert {"--grad-reduce-in-bf16", "--use-precision-aware-optimizer", "--use-distributed-optimizer"} <= set(meg)
    assert any("activation_func_fp8_input_store" in n for n in export_plan(plans["recipe"], "megatron").notes)
    assert meg["--exp-avg-dtype"] == meg["--exp-avg-sq-dtype"] == ["bf16"]
    assert meg["--recompute-granularity"] == ["selective"]
    assert meg["--recompute-modules"] == ["layernorm", "mla_up_proj", "moe_act"]
    mind = _args(export_plan(plans["recipe"], "mindspeed-llm").document())
    assert {"--recompute-norm", "--recompute-mla-up-proj", "--recompute-activation-function"} <= set(mind)


@pytest.mark.parametrize("target", ["megatron", "mindspeed-llm"])
def test_718b_flags_and_degrees(plan_718b, target):
    lay = plan_718b.layout
    ex, args = _check_real_flags(plan_718b, target)
    assert args["--tensor-model-parallel-size"] == [str(lay.tp)]
    assert args["--pipeline-model-parallel-size"] == [str(lay.pp)]
    assert args["--context-parallel-size"] == [str(lay.cp)]
    assert args["--global-batch-size"] == [str(lay.global_batch)]
    overlap = plan_718b.comm.overlap
    if target == "megatron" and "fb" in overlap:  # Megatron refuses the shared-expert overlap beside EP A2A overlap
        assert "--overlap-moe-expert-parallel-comm" in args and "--moe-shared-expert-overlap" not in args
        assert any(n.startswith("comm.overlap shared-expert left out: Megatron-LM refuses") for n in ex.notes)
    if target == "mindspeed-llm" and {"fb", "dp"} <= set(overlap):  # MindSpeed refuses fb with DP overlap
        assert "--overlap-grad-reduce" not in args
        assert any(n.startswith("comm.overlap dp left out: MindSpeed refuses") for n in ex.notes)
        # and this plan's empty layers sit outside the last VPP stage, which MindSpeed refuses with fb under VPP:
        # fb is left out too, not written beside a note that says MindSpeed refuses it
        assert "--moe-fb-overlap" not in args
        assert any(n.startswith("--moe-fb-overlap left out: MindSpeed refuses --noop-layers") for n in ex.notes)


def test_megatron_layout_follows_the_stages(plans):
    plan = plans["pp2vpp2"]
    args = _args(export_plan(plan, "megatron").text)
    stages = args["--pipeline-model-parallel-layout"][0].split("|")
    assert len(stages) == plan.layout.pp * plan.layout.vpp
    for letters, names in zip(stages, pipeline_stages(plan)):
        assert letters.count("t") == sum(n.startswith("layers.") for n in names)
        assert letters.count("m") == sum(n.startswith("mtp.") for n in names)
        assert ("E" in letters) == ("embedding" in names) and ("L" in letters) == ("head" in names)
    lay = plan.layout
    assert args["--expert-model-parallel-size"] == [str(lay.ep * lay.tp // lay.etp)]
    assert args["--mtp-num-layers"] == [str(plan.model.spec.num_mtp_layers)]


def test_mindspeed_noop_layers_fill_the_slots(plans):
    plan = plans["pp2vpp2"]
    spec, lay = plan.model.spec, plan.layout
    args = _args(export_plan(plan, "mindspeed-llm").text)
    total, per_stage = int(args["--num-layers"][0]), int(args["--num-layers-per-virtual-pipeline-stage"][0])
    noop = [int(i) for i in args["--noop-layers"][0].split(",")]
    assert total == per_stage * lay.pp * lay.vpp
    assert total - len(noop) == spec.num_layers  # every slot that is not a decoder layer is a noop layer
    slots = [n for names in pipeline_stages(plan) for n in names if n not in ("embedding", "head")
             and not n.startswith("mtp_head.")]
    assert [slots[i] for i in noop] == [n for n in slots if not n.startswith("layers.")]


def test_mindspeed_num_layer_list_for_a_free_split(plans):
    plan = plans["free-pp4"]
    args = _args(export_plan(plan, "mindspeed-llm").text)
    counts = [int(c) for c in args["--num-layer-list"][0].split(",")]
    assert counts == [sum(n.startswith("layers.") for n in names) for names in pipeline_stages(plan)]
    assert sum(counts) == int(args["--num-layers"][0]) == plan.model.spec.num_layers


@pytest.mark.parametrize("target", ["megatron", "mindspeed-llm"])
@pytest.mark.parametrize("name", ["ilp", "mindspeed"])
def test_per_op_decisions_are_emitted_or_listed(plans, name, target):
    """Each per-tensor decision is either carried by a flag of its ``PlanOpDecision.flag`` or named in a note."""
    ex = export_plan(plans[name], target)
    args, notes = _args(ex.text), "\n".join(ex.notes)
    decisions = {(o.decision, o.label, o.flag) for m in plans[name].memory.ranks for d in m.decisions for o in d.ops}
    assert decisions
    for decision, label, flag in decisions:
        emitted = flag is not None and any(
            (f in args and not v) or (f == "--recompute-modules" and v[0] in args.get(f, []))
            for f, *v in (alt.split(" (")[0].split() for alt in flag.split(" / ")))
        assert emitted or f"'{label}'" in notes, (decision, label, flag)


def test_torchtitan_toml_holds_the_degrees(plans, plan_718b):
    for plan in (*plans.values(), plan_718b):
        ex = export_plan(plan, "torchtitan")
        cfg = tomllib.loads(ex.document())
        keys = {f"{section}.{k}" for section, table in cfg.items() for k in table}
        assert keys <= TORCHTITAN_KEYS, keys - TORCHTITAN_KEYS
        lay, par = plan.layout, cfg["parallelism"]
        assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"],
                par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"]) == (lay.tp, lay.pp, lay.cp,
                                                                                              lay.dp)
        assert par["expert_parallel_degree"] * lay.etp == lay.ep * lay.tp
        assert cfg["training"]["global_batch_size"] == lay.global_batch
        if lay.pp > 1:
            assert len(par["module_fqns_per_model_part"]) == lay.pp * lay.vpp
            assert cfg["training"]["local_batch_size"] // par["pipeline_parallel_microbatch_size"] \
                == lay.num_microbatches


def _runtime_from_csv(path: Path, plan, rank: int) -> _PipelineScheduleRuntime:
    """A runtime of one PP rank built the way torch's own schedule tests do, with stand-in stages (only their
    indices and group are read before ``step``)."""
    lay = plan.layout
    stages = [SimpleNamespace(num_stages=lay.pp * lay.vpp, group_size=lay.pp, group_rank=rank, stage_index=s)
              for s in sorted({p.stage for a in plan.schedule.actions[rank] for p in compute_parts(a)})]
    runtime = _PipelineScheduleRuntime(stages, lay.num_microbatches, loss_fn=lambda out, target: out.sum())
    runtime._load_csv(str(path), format="compute_comms")
    return runtime


@pytest.mark.parametrize("name", ["pp2vpp2", "dualpipev", "ilp"])
def test_torch_reads_the_csv_back_as_the_plans_actions(plans, name, tmp_path):
    """torch loads the CSV unchanged: the plan's actions, plus REDUCE_GRAD where torch's own lowering
    (``_add_reduce_grad``) puts it."""
    plan = plans[name]
    ex = export_plan(plan, "torch-pipelining")
    path = tmp_path / "schedule.csv"
    path.write_text(ex.document())
    expected = {r: [str(a) for a in _add_reduce_grad([_Action.from_str(s) for s in acts], plan.layout.num_microbatches)]
                for r, acts in enumerate(plan.schedule.actions)}
    for rank in range(plan.layout.pp):
        runtime = _runtime_from_csv(path, plan, rank)
        loaded = {r: [str(a) for a in acts] for r, acts in runtime.pipeline_order_with_comms.items()}
        assert loaded == expected
        assert {r: [a for a in acts if "REDUCE_GRAD" not in a] for r, acts in loaded.items()} \
            == {r: list(acts) for r, acts in enumerate(plan.schedule.actions)}
        assert runtime.stage_index_to_group_rank == {
            s: r for r, chunks in enumerate(plan.stages.chunks) for s in
            {p.stage for a in plan.schedule.actions[r] for p in compute_parts(a)}}
    assert ("OVERLAP_F_B" in ex.text) == any("OVERLAP_F_B" in n for n in ex.notes)


def _run_cli(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["moeplan", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code


def test_cli_writes_the_export(plans, tmp_path, monkeypatch, capsys):
    path = tmp_path / "p.yaml"
    save_plan(plans["pp2vpp2"], path)
    assert _run_cli(monkeypatch, "export", str(path), "--to", "megatron") == 0
    assert capsys.readouterr().out == export_file(path, "megatron").document()
    out = tmp_path / "s.csv"
    assert _run_cli(monkeypatch, "export", str(path), "--to", "torch-pipelining", "-o", str(out)) == 0
    assert out.read_text() == export_file(path, "torch-pipelining").text
    assert capsys.readouterr().err.startswith("# load on every PP rank")


def _bad_plans(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    text = good.read_text()
    (tmp_path / "version.yaml").write_text(text.replace(f"schema_version: {SCHEMA_VERSION}", "schema_version: 99"))
    (tmp_path / "truncated.yaml").write_text(text[: len(text) // 2] + "\n  - [unclosed")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    return {"version": (tmp_path / "version.yaml", "schema_version=99"),
            "truncated": (tmp_path / "truncated.yaml", "plan="),
            "binary": (tmp_path / "binary.yaml", "plan=")}


@pytest.mark.parametrize("case", ["version", "truncated", "binary", "target"])
def test_bad_input_exits_2_with_one_line(plans, tmp_path, monkeypatch, capsys, case):
    good = tmp_path / "good.yaml"
    save_plan(plans["pp2vpp2"], good)
    path, needle = _bad_plans(tmp_path, good)[case] if case != "target" else (good, "to='nemo'")
    out = tmp_path / "out.txt"
    code = _run_cli(monkeypatch, "export", str(path), "--to", "nemo" if case == "target" else "megatron",
                    "-o", str(out))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err
    assert not out.exists()
    with pytest.raises(PlanError):
        export_file(path, "nemo" if case == "target" else "megatron")


def test_targets_are_the_documented_ones():
    doc = (Path(__file__).parents[1] / "docs" / "export.md").read_text()
    assert all(f"--to {t}" in doc for t in TARGETS)


# ---- the exported CSV run by torch's runtime against moeplan's own ------------------------------------------------
class _Stage(torch.nn.Module):
    """One pipeline stage of moeplan's runtime modules (moeplan.runtime.build) as a torch.distributed.pipelining
    submodule: carry tensors in and out (moeplan.runtime.executor.Carry), the micro-batch's tokens and labels as
    keyword arguments, which torch hands to every stage."""

    def __init__(self, plan, stage: int, layers) -> None:
        from moeplan.ir import kind_of
        from moeplan.runtime.executor import fields_after, stage_layers

        super().__init__()
        self.layers = layers
        self.names = [(n, kind_of(plan.model.spec, n)) for n in stage_layers(plan, stage)]
        self.fields = fields_after(plan, [n for s in range(stage) for n in stage_layers(plan, s)])
        self.num_mtp = plan.model.spec.num_mtp_layers

    def forward(self, *tensors, tokens, labels):
        from moeplan.models import DEFAULT_MTP_WEIGHT
        from moeplan.runtime.data import MicroBatch
        from moeplan.runtime.executor import Carry, run_layer

        carry = Carry.from_tensors(self.fields, tensors)  # the first stage's tensors are the tokens: unused
        mb = MicroBatch(tokens=tokens, labels=labels)
        for name, kind in self.names:
            carry = run_layer(name, kind, self.layers[name], carry, mb, num_mtp=self.num_mtp,
                              mtp_weight=DEFAULT_MTP_WEIGHT)
        out = carry.tensors()  # the last stage's loss as [1]: torch concatenates the stage outputs of a step
        return out if len(out) > 1 else out[0] if out[0].dim() else out[0].reshape(1)


def _torch_vs_moeplan(rank: int, world: int, init_file: str, plan_path: str, csv_path: str, out_dir: str) -> None:
    """One rank: step 0 of the plan with moeplan's PipelineExecutor, then with torch's _PipelineScheduleRuntime
    running the exported CSV on the same modules; writes both losses and the largest gradient difference."""
    import json
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from moeplan.plan import load_plan
    from moeplan.runtime.build import build_rank_modules
    from moeplan.runtime.data import global_batch, rank_microbatches
    from moeplan.runtime.executor import PipelineExecutor
    from moeplan.runtime.groups import make_groups
    from moeplan.runtime.metrics import CommTotals, SavedActivationMeter

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        plan = load_plan(plan_path)
        lay, spec = plan.layout, plan.model.spec
        coords, groups = make_groups(lay, rank)
        modules = build_rank_modules(plan, coords, groups, seed=0, device=torch.device("cpu"))
        params = {f"{s}.{n}": p for s, m in modules.items() for n, p in m.named_parameters()}
        stream = torch.randint(0, spec.vocab_size, (lay.global_batch * (lay.seq_len + 1),),
                               generator=torch.Generator().manual_seed(0))
        mbs = rank_microbatches(global_batch(stream, step=0, global_batch=lay.global_batch, seq_len=lay.seq_len),
                                dp_rank=0, dp=1, micro_batch=lay.micro_batch)
        ours = PipelineExecutor(plan, pp_rank=coords.pp_rank, pp_ranks=groups.pp_ranks, modules=modules,
                                meter=SavedActivationMeter(params.values()), comm_classes={}, localize=lambda mb: mb)
        our_loss, _ = ours.run_step(mbs, CommTotals(), metered=False)
        our_grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        for p in params.values():
            p.grad = None
        stages = [PipelineStage(_Stage(plan, s, modules[s]), s, lay.pp * lay.vpp, torch.device("cpu"))
                  for s in sorted(modules)]
        theirs = _PipelineScheduleRuntime(stages, lay.num_microbatches, loss_fn=lambda out, target: out.sum())
        theirs._load_csv(csv_path, format="compute_comms")
        tokens, labels = torch.cat([mb.tokens for mb in mbs]), torch.cat([mb.labels for mb in mbs])
        losses: list = []
        theirs.step(tokens, target=labels, losses=losses, tokens=tokens, labels=labels)
        diff = max((p.grad - our_grads[n]).abs().max().item() / our_grads[n].abs().max().clamp_min(1e-12).item()
                   for n, p in params.items() if n in our_grads)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(dict(
            ours=our_loss, theirs=sum(float(x.detach()) for x in losses), grad_rel_diff=diff,
            grads=sorted(our_grads), their_grads=sorted(n for n, p in params.items() if p.grad is not None))))
    finally:
        dist.destroy_process_group()


def test_torch_runtime_on_the_csv_matches_moeplans_runtime(tmp_path):
    """tiny-pangu, pp 2 × vpp 2 on 2 gloo ranks (interleaved, empty and MTP layers): torch's runtime running the
    exported CSV gives moeplan's losses and gradients (same modules, same micro-batches)."""
    import json

    import torch.multiprocessing as mp

    plan = _tiny(devices=2, pp=2, vpp=2, schedule="interleaved")
    plan_path, csv_path = tmp_path / "plan.yaml", tmp_path / "schedule.csv"
    save_plan(plan, plan_path)
    csv_path.write_text(export_plan(plan, "torch-pipelining").document())
    mp.spawn(_torch_vs_moeplan, args=(2, str(tmp_path / "init"), str(plan_path), str(csv_path), str(tmp_path)),
             nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    last = ranks[plan.layout.pp - 1]
    assert last["ours"] > 0 and last["theirs"] == pytest.approx(last["ours"], rel=1e-5)
    for r in ranks:
        assert r["grads"] and r["grads"] == r["their_grads"]
        assert r["grad_rel_diff"] < 1e-5


def test_an_exporter_is_one_registered_function(plans, tmp_path, monkeypatch, capsys):
    """A new format is a function registered under its ``--to`` name (moeplan/export/registry.py): the CLI exports
    with it and lists it among the known targets, with no other file changed. An unknown name is refused."""
    from moeplan.export import registry
    from moeplan.export.registry import Export

    monkeypatch.setattr(registry, "EXPORTERS", dict(registry.EXPORTERS))

    @registry.register("layout-json", source="a test")
    def layout_json(plan):
        return Export("layout-json", plan.layout.model_dump_json() + "\n", ("a note",), True)

    path = tmp_path / "plan.yaml"
    save_plan(plans["pp2vpp2"], path)
    assert _run_cli(monkeypatch, "export", str(path), "--to", "layout-json") == 0
    out = capsys.readouterr().out
    assert out.startswith("# moeplan export --to layout-json · a test\n") and '"pp":2' in out
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("layout-json", source="again")(layout_json)
    with pytest.raises(PlanError, match=r"to='nemo': must be one of megatron, .*, layout-json"):
        export_plan(plans["pp2vpp2"], "nemo")


def test_plan_text_cannot_break_out_of_an_exported_script(plans, tmp_path):
    """A plan field holding a line break (``label: "x'\\ntouch pwned #"``) would end the ``#`` comment of an
    exported script and start a command: the plan is refused with one line naming the field, and a note that holds
    one stays commented line by line."""
    import re

    from moeplan.export.registry import Export

    path = tmp_path / "p.yaml"
    save_plan(plans["ilp"], path)
    text, n = re.subn(r"label: [^\n]*", lambda m: 'label: "x\'\\ntouch pwned #"', path.read_text(), count=1)
    assert n == 1
    path.write_text(text)
    with pytest.raises(PlanError, match=r"\.label=.*one line of printable characters") as e:
        export_file(path, "megatron")
    assert "\n" not in str(e.value)
    doc = Export("megatron", "--tp 1\n", ("fine", "x'\ntouch pwned #"), commented=True).document()
    assert [ln for ln in doc.splitlines() if not ln.startswith("#")] == ["--tp 1"]


FB_FLAG = {"megatron": "--overlap-moe-expert-parallel-comm", "mindspeed-llm": "--moe-fb-overlap"}


@pytest.mark.parametrize("runtime, to", [("megatron-lm", "megatron"), ("mindspeed-llm", "mindspeed-llm")])
def test_no_export_writes_a_combination_its_runtime_refuses(plans, plan_718b, runtime, to):
    """Issue 34: the Megatron export's note said --overlap-moe-expert-parallel-comm needs VPP when pp > 1, and the
    export still wrote the flag. Over 9 plans (8 small ones reaching every branch, the 718B's), a mechanism the
    runtime refuses in the plan's setup (moeplan/runtimes.py, the table the search reads too) gets no flag, and the
    pairs each runtime refuses at start-up never appear together. A DualPipeV plan with fb and the shared-expert
    overlap keeps the shared-expert flag for Megatron-LM: it is refused only beside fb, which goes."""
    from moeplan.export.common import OVERLAP_FLAGS, plan_setup
    from moeplan.runtimes import RUNTIMES

    for name, plan in {**plans, "718b": plan_718b}.items():
        ex = export_plan(plan, to)
        args = set(_args(ex.text))
        assert not any("refuses this combination" in n for n in ex.notes), (name, ex.notes)
        for r in RUNTIMES[runtime].decide(plan_setup(plan))[1]:
            assert not set({"fb": (FB_FLAG[to],), **OVERLAP_FLAGS}[r.mechanism]) & args, (name, r)
            assert any(n.startswith(f"comm.overlap {r.mechanism} left out") for n in ex.notes), (name, r)
        refused_pairs = ([{FB_FLAG[to], "--moe-shared-expert-overlap"}] if to == "megatron" else
                         [{FB_FLAG[to], "--overlap-grad-reduce"}, {FB_FLAG[to], "--swap-attention"}])
        assert not any(pair <= args for pair in refused_pairs), name
        if FB_FLAG[to] in args and plan.layout.pp > 1:  # both need VPP (or, in MindSpeed, DualPipeV) then
            assert plan.layout.vpp > 1, name
    dual = plans["dualpipev"]
    if to == "megatron" and plan_setup(dual).overlap >= {"fb", "shared-expert"}:
        assert "--moe-shared-expert-overlap" in _args(export_plan(dual, to).text)


def test_the_search_for_a_megatron_target_plans_only_what_megatron_runs():
    """A target whose runtime is Megatron-LM (``runtime.name``, or ``compile --runtime megatron-lm``): the default
    search of strategies picks what Megatron-LM runs, and the export carries no note of a refused or missing
    feature. Without the runtime, the same compiles pick zero-bubble (tiny-pangu) and DualPipeV (GLM-4.5-Air)."""
    from moeplan.export.common import plan_setup
    from moeplan.runtimes import RUNTIMES

    target = load_target("h100", runtime="megatron-lm")
    tiny = load_spec("tiny-pangu")
    air = load_spec(str(Path(__file__).parent / "fixtures" / "hf" / "glm-4.5-air" / "config.json"))
    cases = [(tiny, 16, Fixed(global_batch=64, seq_len=tiny.seq_len, ep=8, pp=2)),
             (air, 128, Fixed(global_batch=air.global_batch, seq_len=air.seq_len, tp=4, pp=2, ep=4, cp=2))]
    for spec, devices, fixed in cases:
        plan = compile_model(spec=spec, target=target, num_devices=devices, fixed=fixed, workers=1).plan
        assert plan.schedule.kind in ("1f1b", "interleaved") and plan.comm.dispatcher in ("flat", "dedup")
        assert not RUNTIMES["megatron-lm"].refusals(plan_setup(plan)), spec.name
        notes = export_plan(plan, "megatron").notes
        assert not [n for n in notes if "left out" in n or "refuse" in n or "schedule.kind" in n
                    or "placement" in n or "dispatcher" in n], notes
    assert "fb" in plan.comm.overlap  # the GLM-4.5-Air plan runs Megatron's EP overlap, with VPP


def test_a_fixed_overlap_the_runtime_refuses_is_named():
    """``--overlap fb`` on PP 2 without VPP for Megatron-LM: every layout was refused as "no schedule searched fits",
    which named neither the mechanism nor Megatron's rule; the refusal now says both."""
    from moeplan.errors import LayoutError

    target = load_target("h100", runtime="megatron-lm")
    with pytest.raises(LayoutError, match=r"^runtime: Megatron-LM refuses overlap fb under 1f1b on tp1 pp2 vpp1 ep2 "
                                          r".*: --overlap-moe-expert-parallel-comm needs virtual pipeline stages "
                                          r"when pp > 1"):
        compile_model(spec=load_spec("tiny-pangu"), target=target, num_devices=4, workers=1,
                      fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=1, ep=2, overlap=frozenset({"fb"})))


def test_tp_extend_ep_is_exported_when_mindspeed_leaves_fb_out():
    """A tp-extend-ep layout (etp 1 < tp 2) whose fb MindSpeed refuses (pp 2 without VPP or DualPipeV): fb gets no
    flag, so the shorter --moe-tp-extend-ep is free to use; the exporter decided it from the plan's fb and wrote the
    folded grid with a note about a conflict that the export no longer has."""
    plan = _tiny("h800", 16, global_batch=32, pp=2, vpp=1, tp=2, ep=4, etp=1, schedule="1f1b", dispatcher="flat",
                 overlap=frozenset({"fb"}))
    assert "fb" in plan.comm.overlap and plan.layout.tp_extend_ep
    ex = export_plan(plan, "mindspeed-llm")
    assert "--moe-tp-extend-ep" in ex.text and "--moe-fb-overlap" not in ex.text
    assert "--expert-model-parallel-size 4" in ex.text and "--expert-tensor-parallel-size" not in ex.text
    assert any("comm.overlap fb left out" in n for n in ex.notes) and not any("tp_extend_ep" in n for n in ex.notes)


def test_a_dualpipev_plan_exports_its_uneven_split_the_runtimes_way(plans):
    """DeepSeek-V3 / Kimi-K2's 61 layers on PP 16 with DualPipeV were exported as a bare --num-layers 61 (issue 34).
    MindSpeed-LLM runs DualPipeV: its export pads the V stages with noop layers to equal slot counts (the same as
    for VPP; MindSpeed has no layout flag for DualPipeV). Megatron-LM has no DualPipeV: its export says so and writes
    no --pipeline-model-parallel-layout, whose loop order would place the V's stages on the wrong ranks."""
    plan = plans["dualpipev"]
    spec, lay = plan.model.spec, plan.layout
    args = _args(export_plan(plan, "mindspeed-llm").text)
    assert args["--schedules-method"] == ["dualpipev"]
    total, noop = int(args["--num-layers"][0]), args["--noop-layers"][0].split(",")
    assert total - len(noop) == spec.num_layers and total % (lay.pp * lay.vpp) == 0, args
    ex = export_plan(plan, "megatron")
    assert "--pipeline-model-parallel-layout" not in _args(ex.text)
    assert any(n.startswith("schedule.kind='dualpipev': Megatron-LM has no such schedule") for n in ex.notes)
