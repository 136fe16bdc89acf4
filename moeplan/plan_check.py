"""A plan's internal consistency (:func:`check_plan`, run by ``load_plan`` in moeplan/plan.py once the schema has
validated the file; docs/architecture.md §6).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from moeplan.actions import compute_parts, parse_action
from moeplan.errors import PlanError
from moeplan.ir import kind_of, named_layers

if TYPE_CHECKING:
    from moeplan.plan import Plan


def check_plan(plan: Plan) -> None:
    """Check a plan's internal consistency; raise PlanError naming the first problem.

    Rules: the model hash matches its spec; tp·cp·dp·pp equals the device count; the global batch is
    dp·micro_batch·num_microbatches sequences, and the layout's seq_len and global_batch are the spec's; the memory
    budget is within the target's device memory; the stages have pp ranks of vpp chunks; every layer of the model
    sits on exactly one chunk (empty layers only as listed), in the model's order along the stages; the schedule has
    one action list per PP rank and every action is of the pipelining notation on a stage the rank holds.
    """
    lay, spec = plan.layout, plan.model.spec
    if spec.fingerprint() != plan.model.fingerprint:
        raise PlanError(f"model.fingerprint={plan.model.fingerprint!r}: does not match the spec "
                        f"({spec.fingerprint()}); the spec was edited")
    if lay.tp * lay.cp * lay.dp * lay.pp != lay.num_devices:
        raise PlanError(f"layout.num_devices={lay.num_devices}: must equal tp·cp·dp·pp "
                        f"= {lay.tp * lay.cp * lay.dp * lay.pp}")
    if lay.dp * lay.micro_batch * lay.num_microbatches != lay.global_batch:
        raise PlanError(f"layout.global_batch={lay.global_batch}: must equal dp·micro_batch·num_microbatches "
                        f"= {lay.dp}·{lay.micro_batch}·{lay.num_microbatches} = "
                        f"{lay.dp * lay.micro_batch * lay.num_microbatches} sequences")
    for name in ("seq_len", "global_batch"):
        if getattr(lay, name) != getattr(spec, name):
            raise PlanError(f"layout.{name}={getattr(lay, name)}: must equal the model's {name} "
                            f"({getattr(spec, name)}), the shape the plan was compiled for")
    if plan.memory.budget_bytes > plan.target.memory_bytes:
        raise PlanError(f"target.memory_bytes={plan.target.memory_bytes:g}: below the plan's memory budget "
                        f"({plan.memory.budget_bytes} bytes per device, never above the device's memory); the target "
                        f"was edited")
    if len(plan.stages.chunks) != lay.pp or any(len(c) != lay.vpp for c in plan.stages.chunks):
        raise PlanError(f"stages.chunks: must hold pp={lay.pp} ranks of vpp={lay.vpp} chunks")
    _check_layers(plan)
    _check_actions(plan)


def _check_layers(plan: Plan) -> None:
    spec, seen = plan.model.spec, {}
    for r, chunks in enumerate(plan.stages.chunks):
        for c, names in enumerate(chunks):
            for n in names:
                if n in seen:
                    raise PlanError(f"stages: layer {n!r} is on pp rank {seen[n]} and pp rank {r}")
                if n.startswith("empty."):
                    if n not in plan.stages.empty_layers:
                        raise PlanError(f"stages: empty layer {n!r} is not listed in stages.empty_layers")
                else:
                    try:
                        kind_of(spec, n)
                    except (KeyError, ValueError):
                        raise PlanError(f"stages: layer {n!r} is not a layer of {plan.model.name}") from None
                seen[n] = r
    order = [n for n, _ in named_layers(spec)]
    missing = [n for n in order if n not in seen]
    if missing:
        raise PlanError(f"stages: layer {missing[0]!r} is on no pp rank")
    at = {n: i for i, n in enumerate(order)}
    placed = [n for names in plan.stages.by_stage() for n in names if n in at]
    for before, n in zip(placed, placed[1:]):
        if at[n] < at[before]:
            raise PlanError(f"stages: layer {n!r} comes after {before!r} along the stages; each stage holds a "
                            f"contiguous run of the model's layers, in the model's order")


def _check_actions(plan: Plan) -> None:
    lay = plan.layout
    if len(plan.schedule.actions) != lay.pp:
        raise PlanError(f"schedule.actions: {len(plan.schedule.actions)} lists for pp={lay.pp} ranks")
    for r, actions in enumerate(plan.schedule.actions):
        own = {plan.stages.stage_of(r, c) for c in range(lay.vpp)}
        for a in actions:  # well-formed: PlanSchedule decoded and parsed every action
            parsed = parse_action(a)
            for part in compute_parts(a) or ((parsed,) if parsed.microbatch >= 0 else ()):
                if part.stage not in own:
                    raise PlanError(f"schedule.actions[{r}]: {a!r} runs stage {part.stage}, which pp rank {r} does "
                                    f"not hold")
                if part.microbatch >= lay.num_microbatches:
                    raise PlanError(f"schedule.actions[{r}]: {a!r} names micro-batch {part.microbatch} of "
                                    f"{lay.num_microbatches}")
