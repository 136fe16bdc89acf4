"""The training runtimes a plan may be run by, and what each one runs: one table that the layout search and the
exporters both read (docs/export.md, "Runtimes").

A target names its runtime (``runtime.name`` in its YAML, or ``moeplan compile --runtime``). Then the search tries
only the schedules, dispatchers and overlap mechanisms that runtime runs, and drops an overlap mechanism in a
combination the runtime refuses at start-up; the exporter for that runtime reads the same rules, so it never writes
a flag combination its runtime refuses. Without a name, every schedule, dispatcher and mechanism of the target's
``runtime`` lists is searched, as for a runtime that runs them all (moeplan's own, or torch.distributed.pipelining).

Each rule cites the runtime's own check at the commit the exporters were checked against (docs/export.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

RuntimeName = Literal["megatron-lm", "mindspeed-llm"]


@dataclass(frozen=True)
class Setup:
    """What the rules of a runtime look at: the schedule kind, the layout's pipeline and expert grid, the dispatcher,
    the overlap mechanisms and, once the memory pass has chosen them, the whole-layer recompute mode of each PP rank
    (``None``: not chosen yet)."""

    schedule: str
    pp: int
    vpp: int
    expert_shards: int
    etp: int
    dispatcher: str
    overlap: frozenset[str]
    recompute: tuple[str, ...] | None = None

    @classmethod
    def of(cls, layout, schedule: str, dispatcher: str, overlap, recompute: tuple[str, ...] | None = None) -> "Setup":
        """The setup of ``layout`` (a search ``Layout`` or a plan's ``PlanLayout``: pp, vpp, expert_shards, etp) under
        a strategy."""
        return cls(schedule=schedule, pp=layout.pp, vpp=layout.vpp, expert_shards=layout.expert_shards,
                   etp=layout.etp, dispatcher=dispatcher, overlap=frozenset(overlap), recompute=recompute)

    @property
    def interleaved(self) -> bool:
        """VPP chunks placed in a loop (1F1B interleaved); ZB-V and DualPipeV place them in a V."""
        return self.vpp > 1 and self.schedule not in ("zbv", "dualpipev")


@dataclass(frozen=True)
class Refusal:
    """An overlap mechanism the runtime refuses in this setup, and why (with the source of the rule)."""

    mechanism: str
    reason: str


@dataclass(frozen=True)
class Runtime:
    """A runtime: its display name, the schedules, dispatchers and overlap mechanisms it runs, whether it shards
    parameters (FSDP), and its rules on combinations (:meth:`refusals`)."""

    name: str
    title: str
    schedules: tuple[str, ...]
    dispatchers: tuple[str, ...]
    overlap: tuple[str, ...]
    fsdp: bool

    def refusals(self, s: Setup) -> list[Refusal]:
        """The mechanisms of ``s.overlap`` this runtime refuses in setup ``s``, each with its reason."""
        out: list[Refusal] = []
        if "fb" in s.overlap:
            out += [Refusal("fb", why) for why in _FB_NEEDS[self.name](s)]
        for mech, rule in _BESIDE[self.name]:
            if mech in s.overlap and (why := rule(s)):
                out.append(Refusal(mech, why))
        return out

    def decide(self, s: Setup) -> tuple[frozenset[str], list[Refusal]]:
        """What of ``s.overlap`` the runtime runs in setup ``s``, and a refusal for each mechanism left out: fb when
        its needs are not met, then what conflicts with the mechanisms kept (so a mechanism refused only beside fb
        stays when fb goes)."""
        fb_why = _FB_NEEDS[self.name](s) if "fb" in s.overlap else []
        kept = s.overlap - {"fb"} if fb_why else s.overlap
        beside = self.refusals(replace(s, overlap=kept))
        return kept - {r.mechanism for r in beside}, [Refusal("fb", why) for why in fb_why] + beside

    def allowed(self, s: Setup) -> frozenset[str]:
        """The mechanisms of ``s.overlap`` the runtime runs in setup ``s`` (:meth:`decide`)."""
        return self.decide(s)[0]


def _megatron_fb(s: Setup) -> list[str]:
    """--overlap-moe-expert-parallel-comm (megatron/core/transformer/transformer_config.py __post_init__ @d98e8a64):
    expert parallelism, virtual pipeline stages when pp > 1, no full recompute, the alltoall or flex dispatcher."""
    why = []
    if s.expert_shards == 1:
        why.append("--overlap-moe-expert-parallel-comm needs expert-model-parallel-size > 1")
    if s.pp > 1 and not s.interleaved:
        why.append("--overlap-moe-expert-parallel-comm needs virtual pipeline stages when pp > 1")
    if s.recompute is not None and "full" in s.recompute:
        why.append("--overlap-moe-expert-parallel-comm refuses full recompute")
    if s.dispatcher not in ("flat", "dedup"):
        why.append("--overlap-moe-expert-parallel-comm needs the alltoall or flex dispatcher")
    return why


def _mindspeed_fb(s: Setup) -> list[str]:
    """--moe-fb-overlap (mindspeed/features_manager/moe/fb_overlap.py @028de58c): expert parallelism with expert-TP
    1, and virtual pipeline stages or DualPipeV when pp > 1."""
    why = []
    if s.expert_shards == 1 or s.etp != 1:
        why.append("--moe-fb-overlap needs expert parallelism with expert-tensor-parallel-size 1")
    if s.pp > 1 and s.vpp == 1 and s.schedule != "dualpipev":
        why.append("--moe-fb-overlap needs virtual pipeline stages or DualPipeV when pp > 1")
    return why


_FB_NEEDS = {"megatron-lm": _megatron_fb, "mindspeed-llm": _mindspeed_fb}
_BESIDE = {
    "megatron-lm": (
        ("shared-expert", lambda s: "fb" in s.overlap and "Megatron-LM refuses --moe-shared-expert-overlap with "
                                                          "--overlap-moe-expert-parallel-comm"),),
    "mindspeed-llm": (
        ("dp", lambda s: "fb" in s.overlap and "MindSpeed refuses --overlap-grad-reduce with --moe-fb-overlap "
                                               "(mindspeed/features_manager/moe/fb_overlap.py)"),
        ("dp", lambda s: s.schedule == "dualpipev" and "MindSpeed refuses --overlap-grad-reduce with DualPipeV "
                                                       "(pipeline_parallel/dualpipev_feature.py)")),
}

RUNTIMES: dict[str, Runtime] = {
    "megatron-lm": Runtime("megatron-lm", "Megatron-LM", schedules=("1f1b", "interleaved"),
                           dispatchers=("flat", "dedup"), overlap=("shared-expert", "fb", "dp", "pp"), fsdp=True),
    "mindspeed-llm": Runtime("mindspeed-llm", "MindSpeed-LLM", schedules=("1f1b", "interleaved", "dualpipev"),
                             dispatchers=("flat",), overlap=("shared-expert", "fb", "dp", "pp"), fsdp=False),
}
"""The runtimes by name. Megatron-LM builds 1F1B or interleaved 1F1B orders only, and dispatches with alltoall or
flex (DeepEP, the plan's ``dedup``); MindSpeed-LLM adds DualPipeV, has the alltoall dispatcher only in the version
checked (its hierarchical all-to-all-v exists up to MindSpeed 2.0.0_core_r0.8.0) and runs ZeRO-1, not FSDP."""
