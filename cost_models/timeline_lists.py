"""The ranks' action lists as the timeline's loop reads them (cost_models/timeline.py; the loop:
cost_models/timeline_core.py): checked, and packed into :class:`~moeplan.cost_models.timeline_core.Actions`.

The checks are cost_models/timeline.py's "Errors": an action that does not parse, a stage out of range, an action
twice, a stage computed on two ranks, a SEND or RECV on a rank that does not compute its stage, a RECV without its
SEND or a SEND without its RECV, a SEND before the part it carries. They run vectorised over the lists
(:func:`pack_actions`); when one fails, the lists are checked again action by action in list order
(:func:`_check_in_order`), which names the first offending action, so the message never depends on how the checks
were ordered.

Each distinct action text is parsed once per process (:class:`_ActionTable`): a schedule's texts (``3F12``, ``(3F1;
4B0)OVERLAP_F_B``) recur across the layouts a search simulates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from moeplan.actions import COMPUTE_KINDS, OVERLAP, RECV_KINDS, SEND_KINDS, parse_action
from moeplan.cost_models import timeline_core as core
from moeplan.errors import PlanError

_Key = tuple[str, int, int]  # (kind, stage, micro-batch)
KINDS = "FBIW"  # the loop's compute part kinds, in its order
BY_KIND = {k: i for i, k in enumerate(KINDS)}
# the table's key kinds: the compute kinds 0..3, then SEND_F, SEND_B, RECV_F, RECV_B
_SEND_F, _SEND_B, _RECV_F, _RECV_B = 4, 5, 6, 7
_CODE = {**BY_KIND, "SEND_F": _SEND_F, "SEND_B": _SEND_B, "RECV_F": _RECV_F, "RECV_B": _RECV_B}


class _ActionTable:
    """Each action text seen in this process, parsed once: its row (action kind, part count, then kind code, stage,
    micro-batch of its first and second key, its text's id, its parts' label ids) and the texts by id. Raises
    PlanError for a text that does not parse (not recorded). Bounded: past ``limit`` texts it starts afresh (the
    lists already handed out stay valid)."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self.limit = limit
        self._reset()

    def _reset(self) -> None:
        self.ids: dict[str, int] = {}
        self.texts: list[str] = []
        self._new: list[tuple[int, ...]] = []  # rows not yet in the array
        self._array = np.zeros((1024, 11), np.int64)  # capacity doubles as texts come
        self._n = 0

    def id(self, text: str) -> int:
        found = self.ids.get(text)
        if found is not None:
            return found
        a = parse_action(text)
        stripped = text.strip()
        if a.kind in COMPUTE_KINDS or a.kind == OVERLAP:
            kind = core.A_COMPUTE
        else:
            kind = core.A_SEND if a.kind in SEND_KINDS else core.A_RECV if a.kind in RECV_KINDS else core.A_NOOP
        parts = a.parts or (a,)
        keys = [(_CODE.get(p.kind, -1), p.stage, p.microbatch) for p in parts] + [(-1, 0, 0)]
        labels = stripped[1:stripped.index(")")].split(";") if len(parts) > 1 else [stripped]
        row = (kind, len(parts) if kind == core.A_COMPUTE else 0, *keys[0], *keys[1], self._text(stripped),
               self._text(labels[0]), self._text(labels[1]) if len(labels) > 1 else -1)
        self.ids[text] = self._n + len(self._new)
        self._new.append(row)
        return self.ids[text]

    def _text(self, text: str) -> int:
        self.texts.append(text)
        return len(self.texts) - 1

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows of these ids, shape (len(ids), 11)."""
        if self._new:
            end = self._n + len(self._new)
            if end > len(self._array):
                grown = np.zeros((max(end, 2 * len(self._array)), 11), np.int64)
                grown[:self._n] = self._array[:self._n]
                self._array = grown
            self._array[self._n:end] = self._new
            self._n, self._new = end, []
        return self._array[ids]

    def ids_of(self, actions: Sequence[Sequence[str]]) -> list[list[int]]:
        """Each list's action ids (PlanError for a text that does not parse)."""
        if self._n + len(self._new) > self.limit:
            self._reset()
        get = self.ids.get
        return [[i if (i := get(t)) is not None else self.id(t) for t in texts] for texts in actions]


_TABLE = _ActionTable()


class PackedLists(NamedTuple):
    """The lists as the loop reads them, and what sizing its buffers and reading its results needs: micro-batches
    ``M``, per rank the programs of its compute parts, their kinds and its SEND count, the RECVs (rank, text id,
    SEND key), the texts by id, each rank's stripped texts (for messages), each stage's rank."""

    actions: core.Actions
    num_microbatches: int
    part_progs: list[np.ndarray]
    part_kinds: list[np.ndarray]
    sends: list[int]
    recvs: np.ndarray
    texts: list[str]
    rank_texts: list[list[str]]
    owner: dict[int, int]


def pack_actions(actions: Sequence[Sequence[str]], num_stages: int) -> PackedLists:
    """Check the lists (module docstring) and pack them; PlanError names the first offending action."""
    try:
        packed = _pack(actions, num_stages)
    except PlanError:
        packed = None
    if packed is None:
        _check_in_order(actions, num_stages)
        raise PlanError("schedule: the action lists failed a check that the in-order check passed (a simulator bug)")
    return packed


def _pack(actions: Sequence[Sequence[str]], S: int) -> PackedLists | None:
    """The packed lists, or None when a check fails (PlanError when an action does not parse)."""
    i8 = np.int64
    ids = _TABLE.ids_of(actions)
    texts = _TABLE.texts
    R = len(actions)
    lengths = np.array([len(x) for x in ids], i8)
    off = np.concatenate(([0], np.cumsum(lengths))).astype(i8)
    flat = np.fromiter((i for x in ids for i in x), i8, count=int(off[-1]))
    rows = _TABLE.rows(flat)
    kind, n = rows[:, 0], rows[:, 1]
    k0, s0, m0, k1, s1, m1 = (rows[:, j] for j in range(2, 8))
    text, label0, label1 = rows[:, 8], rows[:, 9], rows[:, 10]
    rank = np.repeat(np.arange(R, dtype=i8), lengths)
    index = np.arange(len(flat), dtype=i8) - off[rank]  # the position in the rank's list
    real = kind != core.A_NOOP
    pair = n > 1
    M = 1 + int(max(m0[real].max(initial=0), m1[pair].max(initial=0)))
    # every key of a non-no-op action: its kind code, stage, micro-batch, rank, list index
    kk = np.concatenate((k0[real], k1[pair]))
    ks = np.concatenate((s0[real], s1[pair]))
    km = np.concatenate((m0[real], m1[pair]))
    kr = np.concatenate((rank[real], rank[pair]))
    ki = np.concatenate((index[real], index[pair]))
    if ks.size and ks.max() >= S:
        return None
    code = (kk * S + ks) * M + km
    if code.size and np.bincount(code, minlength=8 * S * M).max() > 1:  # an action twice
        return None
    compute = kk < 4
    owner_of = np.full(S, -1, i8)
    owner_of[ks[compute]] = kr[compute]
    if np.any(owner_of[ks[compute]] != kr[compute]):  # a stage computed on two ranks
        return None
    if np.any(owner_of[ks[~compute]] != kr[~compute]):
        return None
    # RECV_F(s, m) needs SEND_F(s − 1, m), RECV_B(s, m) SEND_B(s + 1, m), and every SEND its RECV
    send = (kk == _SEND_F) | (kk == _SEND_B)
    recv = (kk == _RECV_F) | (kk == _RECV_B)
    peers = np.concatenate((ks[recv] + np.where(kk[recv] == _RECV_F, -1, 1),
                            ks[send] + np.where(kk[send] == _SEND_F, 1, -1)))
    if peers.size and (peers.min() < 0 or peers.max() >= S):
        return None
    wanted_send = ((kk[recv] - 2) * S + ks[recv] + np.where(kk[recv] == _RECV_F, -1, 1)) * M + km[recv]
    wanted_recv = ((kk[send] + 2) * S + ks[send] + np.where(kk[send] == _SEND_F, 1, -1)) * M + km[send]
    if not (np.isin(wanted_send, code[send]).all() and np.isin(wanted_recv, code[recv]).all()):
        return None
    # a SEND after the part it carries: F for SEND_F; B, else I, for SEND_B
    nk = 4 * S * M
    pos = np.full(nk, -1, i8)
    pos[code[compute]] = ki[compute]
    ss, sm, sr, si = ks[send], km[send], kr[send], ki[send]
    is_b = kk[send] == _SEND_B
    f_key = (core.KF * S + ss) * M + sm
    b_key = (core.KB * S + ss) * M + sm
    i_key = (core.KI * S + ss) * M + sm
    b_before = (pos[b_key] >= 0) & (pos[b_key] < si)
    i_before = (pos[i_key] >= 0) & (pos[i_key] < si)
    f_before = (pos[f_key] >= 0) & (pos[f_key] < si)
    if not np.where(is_b, b_before | i_before, f_before).all():
        return None
    producer = np.where(is_b, np.where(b_before, b_key, i_key), f_key)
    send_text = np.concatenate((text[real], text[pair]))[send]
    send_of = np.full(nk, -1, i8)
    send_of[producer] = np.arange(producer.size, dtype=i8)
    s_key = ((kk[send] - _SEND_F) * S + ss) * M + sm
    recv_idx = np.full(2 * S * M, -1, i8)
    rkey = ((kk[recv] - _RECV_F) * S + ks[recv]) * M + km[recv]
    recv_idx[rkey] = ki[recv]
    # the steady window: a rank's pairs, else its first backward to its last forward
    is_compute = kind == core.A_COMPUTE
    has_bwd = is_compute & ((k0 == core.KB) | (k0 == core.KI) | (k0 == core.KW) | (pair & (k1 != core.KF)))
    has_f = is_compute & ((k0 == core.KF) | (pair & (k1 == core.KF)))
    win_lo, win_hi = np.empty(R, i8), np.empty(R, i8)
    next_pair = np.zeros(len(flat), np.bool_)
    for r in range(R):
        a, b = off[r], off[r + 1]
        p = np.flatnonzero(pair[a:b])
        if p.size:
            win_lo[r], win_hi[r] = p[0], p[-1]
        else:
            first, last = np.flatnonzero(has_bwd[a:b]), np.flatnonzero(has_f[a:b])
            win_lo[r] = first[0] if first.size else b - a
            win_hi[r] = last[-1] if last.size else -1
        c = np.flatnonzero(is_compute[a:b])
        nxt = np.searchsorted(c, np.arange(b - a), side="right")  # the next compute action after each
        ok = nxt < c.size
        next_pair[a:b][ok] = pair[a:b][c[nxt[ok]]]
    key0 = np.where(is_compute, (k0 * S + s0) * M + m0, -1)
    key1 = np.where(pair, (k1 * S + s1) * M + m1, -1)
    steady = (index >= win_lo[rank]) & (index <= win_hi[rank])
    ac = core.Actions(off=off, kind=kind.copy(), n=n.copy(), key0=key0, key1=key1,
                      label0=np.where(is_compute, label0, -1), label1=np.where(pair, label1, -1), steady=steady,
                      next_pair=next_pair, owner=owner_of, recv_idx=recv_idx, send_of=send_of, s_key=s_key,
                      s_text=send_text, s_index=si, win_lo=win_lo, win_hi=win_hi)
    # per rank, the programs and kinds of its compute parts (buffer sizes), its SEND count, its RECVs
    pk = np.concatenate((k0[is_compute], k1[pair]))
    pprog = np.concatenate((s0[is_compute], s1[pair])) * 4 + pk
    prank = np.concatenate((rank[is_compute], rank[pair]))
    order = np.argsort(prank, kind="stable")
    split = np.searchsorted(prank[order], np.arange(1, R))
    part_progs = np.split(pprog[order], split)
    part_kinds = np.split(pk[order], split)
    sends = np.bincount(sr, minlength=R).tolist()
    rr = kk[recv] == _RECV_F
    recv_rows = np.stack([kr[recv], np.concatenate((text[real], text[pair]))[recv],
                          ((kk[recv] - _RECV_F) * S + ks[recv] + np.where(rr, -1, 1)) * M + km[recv]], axis=1)
    recv_rows = recv_rows[np.lexsort((ki[recv], kr[recv]))]  # in list order, rank by rank
    rank_texts = [[texts[t] for t in text[off[r]:off[r + 1]].tolist()] for r in range(R)]
    return PackedLists(ac, M, part_progs, part_kinds, sends, recv_rows, texts, rank_texts,
                       {s: int(o) for s, o in enumerate(owner_of.tolist()) if o >= 0})


# ---- the checks action by action, for their messages -----------------------------------------------------------------
@dataclass
class _Rank:
    """One rank's parsed list: per action, its text, kind tag and keys."""

    texts: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "compute", "send", "recv", "noop"
    keys: list[tuple[_Key, ...]] = field(default_factory=list)


def _check_in_order(actions: Sequence[Sequence[str]], num_stages: int) -> None:
    """Raise PlanError naming the first action of the lists that fails a check (module docstring)."""
    ranks, owner = _parse_all(actions, num_stages)
    _check_pairs(ranks, owner)
    for r, rk in enumerate(ranks):
        _sends_of(r, rk)


def _parse_all(actions: Sequence[Sequence[str]], num_stages: int) -> tuple[list[_Rank], dict[int, int]]:
    """Parse every list; map each stage to the one rank that computes it (PlanError on a stage on two ranks, out of
    range, or an action appearing twice)."""
    ranks, owner, seen = [], {}, set()
    for r, texts in enumerate(actions):
        rk = _Rank()
        for text in texts:
            a = parse_action(text)
            keys = tuple((p.kind, p.stage, p.microbatch) for p in (a.parts or (a,)))
            kind = ("compute" if a.kind in COMPUTE_KINDS or a.kind == OVERLAP else "send" if a.kind in SEND_KINDS
                    else "recv" if a.kind in RECV_KINDS else "noop")
            for k in keys if kind != "noop" else ():
                if k[1] >= num_stages:
                    raise PlanError(f"rank {r} action {text.strip()}: stage {k[1]} out of range (the stages have "
                                    f"{num_stages})")
                if k in seen:
                    raise PlanError(f"rank {r} action {text.strip()!r}: appears twice")
                seen.add(k)
                if kind == "compute" and owner.setdefault(k[1], r) != r:
                    raise PlanError(f"rank {r} action {text.strip()}: stage {k[1]} already runs on rank {owner[k[1]]}")
            rk.texts.append(text.strip())
            rk.kinds.append(kind)
            rk.keys.append(keys)
        ranks.append(rk)
    for r, rk in enumerate(ranks):
        for text, kind, keys in zip(rk.texts, rk.kinds, rk.keys):
            if kind in ("send", "recv") and owner.get(keys[0][1]) != r:
                raise PlanError(f"rank {r} action {text!r}: stage {keys[0][1]} computes on rank "
                                f"{owner.get(keys[0][1])}")
    return ranks, owner


def _check_pairs(ranks: Sequence[_Rank], owner: Mapping[int, int]) -> None:
    """Every RECV has its SEND on the neighbour stage and every SEND its RECV."""
    recv_at: dict[_Key, int] = {}
    sends: dict[_Key, int] = {}
    for r, rk in enumerate(ranks):
        for i, (kind, keys) in enumerate(zip(rk.kinds, rk.keys)):
            if kind == "recv":
                recv_at[keys[0]] = i
            elif kind == "send":
                sends[keys[0]] = r
    for kind, stage, mb in recv_at:
        peer = stage - 1 if kind == "RECV_F" else stage + 1
        if ("SEND" + kind[4:], peer, mb) not in sends:
            raise PlanError(f"rank {owner[stage]} action {stage}{kind}{mb}: no rank runs its SEND "
                            f"{peer}SEND{kind[4:]}{mb}")
    for (kind, stage, mb), r in sends.items():
        peer = stage + 1 if kind == "SEND_F" else stage - 1
        if ("RECV" + kind[4:], peer, mb) not in recv_at:
            raise PlanError(f"rank {r} action '{stage}{kind}{mb}': no rank runs its RECV {peer}RECV{kind[4:]}{mb}")


def _sends_of(r: int, rk: _Rank) -> None:
    """PlanError for a SEND of rank ``r`` before the part whose output it carries."""
    done: set[_Key] = set()
    for kind, keys, text in zip(rk.kinds, rk.keys, rk.texts):
        if kind == "compute":
            done.update(keys)
        elif kind == "send":
            skind, stage, mb = keys[0]
            if not any((k, stage, mb) in done for k in (("F",) if skind == "SEND_F" else ("B", "I"))):
                raise PlanError(f"schedule deadlock: rank {r} action {text!r} waits on '{stage}"
                                f"{'F' if skind == 'SEND_F' else 'B'}{mb}' (rank {r}), which can never run")
