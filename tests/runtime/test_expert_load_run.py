"""``moeplan run --record-load`` and ``--aux-loss-coeff/--aux-loss-scope`` (moeplan/runtime/load_record.py,
moeplan/runtime/expert_parallel.py ParallelRouter).

1. Every scope's auxiliary loss against a reference computed directly on all the ranks' tokens: four simulated
   ranks (tp×cp 2 × DP 2, expert groups {0, 3} and {1, 2}, two micro-batches each) run ParallelRouter._aux_share
   with the collectives replaced by sums over the simulated ranks; the sum of the shares, scaled as the executor
   and optimizer scale it (``1/(dp·m)``), equals the mean of the scope's unit losses, and so does its gradient with
   respect to every token's scores.
2. A 2-rank EP 2 run under a per-tensor recompute plan (its layers are probed once and recomputed in backward)
   records a trace whose counts are exactly ``top_k`` per token, layer and step: neither the probe nor the
   recompute counts again; the trace names the model, the MoE layers (the MTP block after the last decoder layer),
   the plan's expert placement and the command. Resumed from its checkpoint for one more step, the run continues
   the same trace.
3. Refusals: one line, exit 2, before any rank starts.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moeplan.compile import compile_model
from moeplan.plan import save_plan
from moeplan.runtime import expert_parallel
from moeplan.runtime.expert_parallel import ParallelRouter, check_aux_loss
from moeplan.runtime.request import AUX_LOSS_SCOPES
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

sys.path.insert(0, str(Path(__file__).parent.parent))
from inprocess import run_moeplan  # noqa: E402

SPEC = load_spec("tiny-pangu")
E, K = SPEC.num_experts, SPEC.top_k

# ---- 1. the share function against the definitions ------------------------------------------------------------------
RANKS, DP, MBS, BATCH, SEQ = 4, 2, 2, 3, 8  # rank r: dp rank r // 2, tp×cp rank r % 2 (holds half of each sequence)
OWN = SEQ // 2
TP_CP = {r: (r - r % 2, r - r % 2 + 1) for r in range(RANKS)}
DP_GROUP = {r: (r % 2, r % 2 + 2) for r in range(RANKS)}
EXPERT = {0: (0, 3), 3: (0, 3), 1: (1, 2), 2: (1, 2)}


class FakeLink:
    """A simulated group: its member ranks (what ParallelRouter reads of a Link is ``size``)."""

    def __init__(self, members: tuple[int, ...]) -> None:
        self.members, self.size = members, len(members)


class Collectives:
    """Stands in for expert_parallel._summed: each simulated rank's inputs are recorded by (rank, micro-batch,
    call); a call returns the sum of the members' inputs of the previous pass (so chained reductions settle after
    as many passes as there are calls)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int, int], torch.Tensor] = {}
        self.before: dict[tuple[int, int, int], torch.Tensor] = {}
        self.rank = self.mb = self.call = 0

    def __call__(self, x: torch.Tensor, link: FakeLink) -> torch.Tensor:
        key = (self.rank, self.mb, self.call)
        self.seen[key] = x.detach().clone()
        self.call += 1
        if not all((m, *key[1:]) in self.before for m in link.members):
            return x.detach()
        return sum(self.before[(m, *key[1:])] for m in link.members)


def _scores() -> torch.Tensor:
    """Sigmoid scores ``[dp, mb, batch, seq, E]`` of every token, with a skew so that experts are unevenly hit."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn((DP, MBS, BATCH, SEQ, E), generator=g, dtype=torch.float64)
    return (logits + torch.linspace(-1, 1, E, dtype=torch.float64)).sigmoid().requires_grad_()


def _runtime_total(scores: torch.Tensor, scope: str, monkeypatch) -> torch.Tensor:
    """Σ over simulated ranks and micro-batches of the routers' shares, times ``1/(dp·m)``."""
    fake = Collectives()
    monkeypatch.setattr(expert_parallel, "_summed", fake)
    total = None
    for _ in range(3):  # dp-group and global-batch chain two reductions
        fake.before, fake.seen, total = fake.seen, {}, 0
        for r in range(RANKS):
            env = SimpleNamespace(layout=SimpleNamespace(seq_len=SEQ), tp_cp_link=FakeLink(TP_CP[r]),
                                  dp_link=FakeLink(DP_GROUP[r]), expert_link=FakeLink(EXPERT[r]))
            router = ParallelRouter(SPEC, env, aux_loss_coeff=1.0, aux_loss_scope=scope)
            for mb in range(MBS):
                own = scores[r // 2, mb, :, (r % 2) * OWN:(r % 2 + 1) * OWN].reshape(-1, E)
                fake.rank, fake.mb, fake.call = r, mb, 0
                total = total + router._aux_share(own, own.topk(K, dim=-1).indices, BATCH * SEQ)
    return total / (DP * MBS)


def _unit_loss(scores: torch.Tensor, f_counts: torch.Tensor, f_tokens: int) -> torch.Tensor:
    """``E Σ_e f_e P_e`` with ``f = counts / (k · f_tokens)`` and ``P`` the mean normalised score of ``scores``."""
    p = scores.reshape(-1, E)
    p = p / p.sum(-1, keepdim=True)
    return E * (f_counts / (K * f_tokens) * p.mean(0)).sum()


def _counts(scores: torch.Tensor) -> torch.Tensor:
    idx = scores.reshape(-1, E).topk(K, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=E).to(torch.float64)


def _reference(scores: torch.Tensor, scope: str) -> torch.Tensor:
    """The mean over the step's units of each unit's loss, from the scope's definition (ParallelRouter)."""
    if scope == "sequence":
        units = [scores[d, mb, b] for d in range(DP) for mb in range(MBS) for b in range(BATCH)]
    elif scope == "micro-batch":
        units = [scores[d, mb] for d in range(DP) for mb in range(MBS)]
    elif scope == "ep-group":  # the tokens of the group's ranks: (dp rank, half of each sequence)
        units = [torch.cat([scores[r // 2, mb, :, (r % 2) * OWN:(r % 2 + 1) * OWN] for r in members])
                 for members in ((0, 3), (1, 2)) for mb in range(MBS)]
    elif scope == "dp-group":
        units = [scores[:, mb] for mb in range(MBS)]
    else:  # global-batch: micro-batch i's f from micro-batches 0..i of every DP rank, P from micro-batch i
        running = torch.cumsum(torch.stack([_counts(scores[:, mb]) for mb in range(MBS)]), 0)
        tokens = DP * BATCH * SEQ
        return torch.stack([_unit_loss(scores[:, mb], running[mb], (mb + 1) * tokens) for mb in range(MBS)]).mean()
    return torch.stack([_unit_loss(u, _counts(u), u[..., 0].numel()) for u in units]).mean()


@pytest.mark.parametrize("scope", AUX_LOSS_SCOPES)
def test_aux_loss_share_is_the_scope_mean_with_its_gradient(scope, monkeypatch):
    scores = _scores()
    got, want = _runtime_total(scores, scope, monkeypatch), _reference(scores, scope)
    assert got.item() == pytest.approx(want.item(), rel=1e-12) and want.item() > 1.0  # skewed: above balance
    (g_got,), (g_want,) = torch.autograd.grad(got, scores), torch.autograd.grad(want, scores)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-14)


def test_scopes_differ_on_skewed_routing(monkeypatch):
    """The five definitions are not the same loss (on this routing, each differs from the others)."""
    values = [_reference(_scores(), s).item() for s in AUX_LOSS_SCOPES]
    assert len({round(v, 9) for v in values}) == len(values), values


# ---- 2. a recorded run ---------------------------------------------------------------------------------------------
STEPS = 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[dict, object]:
    """A 2-rank EP 2 (DP 2) run under per-tensor recompute (mindspeed) with the sequence-wise loss on, recording
    its load: 2 steps with a checkpoint after the second, then resumed for the third: (the trace as JSON, the
    plan)."""
    root = tmp_path_factory.mktemp("load")
    plan = compile_model(spec=SPEC, target=load_target("cpu", devices_per_node=4), num_devices=2,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=1, tp=1, cp=1, ep=2, micro_batch=2,
                                     recompute="mindspeed"), workers=1, candidates=1).plan
    assert {r.recompute for r in plan.memory.ranks} == {"mindspeed"}
    save_plan(plan, root / "plan.yaml")
    for steps, more in ((STEPS - 1, ["--checkpoint-every", "2"]), (STEPS, ["--resume"])):
        proc = subprocess.run([sys.executable, "-m", "moeplan.cli", "run", str(root / "plan.yaml"), "--steps",
                               str(steps), "--record-load", str(root / "load.json"), "--aux-loss-coeff", "0.01",
                               "--aux-loss-scope", "sequence", "--meter-every", "100", "--checkpoint-dir",
                               str(root / "ck"), *more], capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr
        assert f"load trace {root / 'load.json'}: {steps} steps; recording took" in proc.stderr
    return json.loads((root / "load.json").read_text()), plan


def test_trace_counts_top_k_per_token_once(recorded):
    trace, plan = recorded
    counts = np.array(trace["counts"])
    assert trace["steps"] == list(range(1, STEPS + 1)) and counts.shape == (STEPS, 4, E)
    # global batch 8 × seq 64 tokens, top-2: not counted again by the probe or the backward's recompute
    assert (counts.sum(-1) == 8 * 64 * K).all()
    assert counts.min() >= 0 and (counts.max(-1) > counts.min(-1)).all()  # natural routing, not uniform


def test_trace_names_model_layers_placement_and_command(recorded):
    trace, plan = recorded
    assert trace["format"] == "moeplan.expert-load/1" and trace["model"] == "tiny-pangu"
    assert trace["num_experts"] == E and trace["layers"] == [1, 2, 3, 4]  # layers.1-3, then mtp.0 as layer 4
    assert trace["ep"] == 2 and trace["placement"] == [list(s) for s in plan.experts.shards]
    assert trace["source"].startswith("moeplan run ") and "--aux-loss-scope sequence --record-load" in trace["source"]
    assert "--resume" in trace["source"]  # the command of the run that wrote it last


# ---- 3. refusals ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Path:
    """A 2-rank EP 2 plan, and the same with full recompute."""
    root = tmp_path_factory.mktemp("plans")
    plan = compile_model(spec=SPEC, target=load_target("cpu", devices_per_node=4), num_devices=2,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=1, tp=1, cp=1, ep=2, micro_batch=2,
                                     recompute="none"), workers=1, candidates=1).plan
    save_plan(plan, root / "plan.yaml")
    ranks = [r.model_copy(update={"recompute": "full"}) for r in plan.memory.ranks]
    save_plan(plan.model_copy(update={"memory": plan.memory.model_copy(update={"ranks": ranks})}), root / "full.yaml")
    return root


REFUSED = {
    "negative_coeff": (["--aux-loss-coeff", "-0.5"], "aux_loss_coeff=-0.5: must be a finite number >= 0"),
    "nan_coeff": (["--aux-loss-coeff", "nan"], "aux_loss_coeff=nan: must be a finite number >= 0"),
    "unknown_scope": (["--aux-loss-coeff", "0.01", "--aux-loss-scope", "batch"],
                      "aux_loss_scope='batch': must be one of sequence, micro-batch, ep-group, dp-group, global-batch"),
    "scope_without_coeff": (["--aux-loss-scope", "sequence"],
                            "aux_loss_scope=sequence: applies to --aux-loss-coeff, which is 0"),
    "record_load_is_plan": (["--record-load", "{root}/plan.yaml"], "record_load='{root}/plan.yaml': is the plan file"),
    "record_load_no_folder": (["--record-load", "{root}/no/such/load.json"], "does not exist"),
    "old_trace": (["--record-load", "{root}/old.json"], "holds an earlier run's trace"),
    "global_batch_recompute": (["--aux-loss-coeff", "0.01", "--aux-loss-scope", "global-batch", "{full}"],
                               "aux_loss_scope=global-batch: needs a plan without recompute (this one: full)"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_options_are_refused_before_launch(plans, name, monkeypatch):
    args, needle = REFUSED[name]
    (plans / "old.json").write_text("{}\n")
    monkeypatch.setattr("moeplan.runtime.launch.launch_local", lambda *a: pytest.fail("launched"))
    plan = str(plans / ("full.yaml" if "{full}" in args else "plan.yaml"))
    args = [a.format(root=plans) for a in args if a != "{full}"]
    proc = run_moeplan("run", plan, "--steps", "1", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle.format(root=plans) in lines[0], lines[0]


def test_plan_checks_of_the_aux_loss(plans, monkeypatch):
    from moeplan.errors import PlanError
    from moeplan.plan import load_plan

    dense = SimpleNamespace(model=SimpleNamespace(spec=SimpleNamespace(is_moe=False)))
    with pytest.raises(PlanError, match=r"^aux_loss_coeff=0.01: the model has no routed experts$"):
        check_aux_loss(dense, 0.01, "ep-group")
    full = load_plan(plans / "full.yaml")
    monkeypatch.setattr("moeplan.runtime.executor.has_pairs", lambda plan: False)
    check_aux_loss(full, 0.01, "dp-group")
    monkeypatch.setattr("moeplan.runtime.executor.has_pairs", lambda plan: True)
    with pytest.raises(PlanError, match="aux_loss_scope=dp-group: needs a plan without recompute or without"):
        check_aux_loss(full, 0.01, "dp-group")
    for scope in ("sequence", "micro-batch", "ep-group"):
        check_aux_loss(full, 0.01, scope)


def test_request_round_trips_through_the_command_line():
    import typer.main

    from moeplan.cli import app
    from moeplan.cli_options import run_request
    from moeplan.runtime.request import RunRequest

    request = RunRequest(plan="/p.yaml", steps=5, aux_loss_coeff=0.01, aux_loss_scope="ep-group",
                         record_load="/load.json")
    argv = request.cli_args()
    assert argv[-6:] == ["--aux-loss-coeff", "0.01", "--aux-loss-scope", "ep-group", "--record-load", "/load.json"]
    run = typer.main.get_command(app).commands["run"]
    params = dict(run.make_context("run", list(argv)).params)
    del params["devices"], params["print_command"]
    assert run_request(params.pop("plan_path"), **params) == request
    # the coefficient alone takes the default scope; none of them by default
    assert RunRequest(plan="/p.yaml", steps=5).cli_args() == ["/p.yaml", "--steps", "5", "--checkpoint-every", "0",
                                                             "--seed", "0", "--lr", "0.001", "--timeout", "60.0",
                                                             "--meter-every", "1"]
    coeff_only = run_request("/p.yaml", steps=5, metrics=None, data=None, checkpoint_every=0, checkpoint_dir=None,
                             resume=False, seed=0, lr=1e-3, timeout=60.0, meter_every=1,
                             force_balanced_routing=False, no_pin=False, aux_loss_coeff=0.5)
    assert (coeff_only.aux_loss_coeff, coeff_only.aux_loss_scope) == (0.5, "micro-batch")
