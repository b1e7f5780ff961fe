"""Fused Triton attention over the sessions' caches as they lie in memory.

One kernel serves the three shapes of this workload, launched over a host-built *plan*:

- decode: one new token of each of many sessions over ragged caches;
- chunked prefill: a chunk of new tokens over the session's cache, causal within the chunk;
- dual thinking: a reasoning token over `reading[0:visible)` and `thinking[0:t)`, both ranges
  in one pass with one online softmax (no second launch, no partial results to merge);
- shared prefix (flash questions): the queries of many forks stacked against the prefix they
  share, so each prefix tile is loaded once for all of them; each fork's own suffix separately;
  the parts merged by log-sum-exp in a second small kernel.

A sequence attends to an ordered list of *ranges* (`KVRange`): a contiguous run of slots in
some buffer, `[kv_heads, slots, head_dim]`, its first `length` slots valid, either visible in
full or offset-causal (`causal_start`: query i sees key j iff j <= causal_start + i). This is
the pool's real layout: a session's cache is a shared-prefix extent plus its own extent, a
fork's cache is its own buffer; ranges are passed by address, so nothing is gathered or
concatenated. Addresses are taken for layer 0 with the stride between layers, so a plan is
built once per model step and reused by every layer.

The work is cut into *items* (query rows x a slice of a sequence's concatenated ranges) and
tiles of `BLOCK_M` rows; rows are (token, query head of the kv group) pairs, so a K/V tile is
loaded once for the whole query-head group (grouped-query attention). A long cache is split
into several items (flash decoding) when there are too few programs to fill the GPU; split
results go to fp32 partial buffers and are merged. An item that covers its tokens alone writes
the output directly.

Accumulation is fp32 in every dtype (fp16, bf16, fp32); with fp32 inputs the dot products use
IEEE fp32, not TF32, so results match the reference to fp32 rounding.

The kernels are defined when this module is imported: set `TRITON_INTERPRET=1` before that to
run them on the CPU (tests do, in tests/kernels/conftest.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

SEG_FIELDS = 9  # k_addr, v_addr, layer_stride, head_stride, tok_stride (= head_dim), length, diag, base, (pad)
ITEM_FIELDS = 8  # q_lo, n_q, seg_lo, seg_hi, kv_lo, kv_hi, slot, direct
NO_DIAG = 1 << 50  # causal_start of a range every query sees in full
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
MERGE_SLOTS = 64  # partial slots the merge kernel is compiled for: a range set is cut into at most
# half of them (AttentionPlan._splits), so a fork's shared and own parts together fit


# Integer arguments that change from step to step (the layer, strides that follow the step's
# token count) are not specialized: Triton would otherwise compile a variant per value class
# (== 1, divisible by 16, other) of each, seconds of compiling in the middle of serving. What
# is left to specialize is fixed per model (dtype, head shape) but for BLOCK_M (decode or
# prefill tiles): `warm_up` compiles both, and the merge, when the backend is chosen (the merge's
# WRITE_LSE, the log-sum-exps a caller asks for, is not used by the engine's steps).
_VARYING = ["layer", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_ps", "stride_pt", "stride_ph",
            "stride_ls", "stride_lt"]


@triton.jit(do_not_specialize=_VARYING)
def _attention_kernel(Q, OUT, OP, LP, SEG, ITEM, QTOK, TILE, layer, scale_log2,
                      stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                      ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    item = tl.load(TILE + pid * 2).to(tl.int64)
    m_tile = tl.load(TILE + pid * 2 + 1)
    it = ITEM + item * 8
    q_lo = tl.load(it + 0)
    n_q = tl.load(it + 1)
    seg_lo = tl.load(it + 2)
    seg_hi = tl.load(it + 3)
    kv_lo = tl.load(it + 4)
    kv_hi = tl.load(it + 5)
    slot = tl.load(it + 6)
    direct = tl.load(it + 7)

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // G  # query token of each row, within the item
    head = kvh * G + (rows % G)
    row_ok = tok < n_q
    tok_last = tl.minimum(m_tile * BLOCK_M + BLOCK_M - 1, n_q * G - 1) // G
    t_idx = tl.load(QTOK + q_lo + tok, mask=row_ok, other=0).to(tl.int64)  # packed token index
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for si in range(seg_lo, seg_hi):
        sg = SEG + si * 9
        elem = Q.dtype.element_ty
        layer_off = layer * tl.load(sg + 2) + kvh * tl.load(sg + 3)
        k_base = tl.load(sg + 0).to(tl.pointer_type(elem)) + layer_off
        v_base = tl.load(sg + 1).to(tl.pointer_type(elem)) + layer_off
        if ALIGNED:  # every range starts 16-byte aligned (checked on the host): vector loads
            k_base = tl.multiple_of(k_base, 16)
            v_base = tl.multiple_of(v_base, 16)
        length = tl.load(sg + 5)
        diag = tl.load(sg + 6)
        base = tl.load(sg + 7)
        lo = tl.maximum(kv_lo - base, 0)
        hi = tl.minimum(tl.minimum(kv_hi - base, length), diag + tok_last + 1)  # causal: skip tiles past the diagonal
        for start in range(lo, hi, BLOCK_N):
            n_idx = start + tl.arange(0, BLOCK_N)
            n_ok = n_idx < hi
            kv_off = n_idx[:, None].to(tl.int64) * D + d[None, :]  # tokens are D apart (checked on the host)
            k = tl.load(k_base + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2
            visible = n_ok[None, :] & (n_idx[None, :] <= diag + tok[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if direct != 0:
        tl.store(OUT + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=mask)
    else:
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        slot64 = slot.to(tl.int64)
        tl.store(OP + slot64 * stride_ps + t_idx[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :],
                 out, mask=mask)
        tl.store(LP + slot64 * stride_ls + t_idx * stride_lt + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=_VARYING[3:])
def _merge_kernel(OUT, OP, LP, MTOK, NSLOT, LSE, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph,
                  stride_ls, stride_lt, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  WRITE_LSE: tl.constexpr):
    """Combine the partial results of one (token, head) by their log-sum-exps."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    t = tl.load(MTOK + pid).to(tl.int64)
    ns = tl.load(NSLOT + pid)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < ns
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    lse = tl.load(LP + s.to(tl.int64) * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_use)
    total = tl.sum(w, 0)
    w = w / tl.where(total > 0.0, total, 1.0)
    parts = tl.load(OP + s[:, None].to(tl.int64) * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0)
    tl.store(OUT + t * stride_ot + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        tl.store(LSE + pid * tl.num_programs(1) + h, tl.where(total > 0.0, m_use + tl.log(total), float("-inf")))


# Triton's interpreter multiplies bf16 operands of tl.dot as their raw 16-bit integers; under it
# bf16 tiles are widened to fp32 before the dot (the compiled GPU path keeps bf16 tensor cores).
_INTERPRETED = type(_attention_kernel).__name__ == "InterpretedFunction"


@dataclass(slots=True)
class KVRange:
    """A run of cache slots one sequence attends to.

    `k`, `v`: `[kv_heads, >= length, head_dim]` views (of layer 0 when `layer_stride` is set;
    the layer-l buffer then starts `l * layer_stride` elements further on). `causal_start`:
    None when every query sees all `length` keys; else query i (0-based within its sequence's
    new tokens) sees key j iff j <= causal_start + i.
    """

    k: torch.Tensor
    v: torch.Tensor
    length: int
    causal_start: int | None = None
    layer_stride: int = 0

    def __post_init__(self) -> None:
        if self.k.dim() != 3 or self.v.shape != self.k.shape:
            raise ValueError(f"a KV range needs k and v of one shape [kv_heads, slots, d], got "
                             f"{tuple(self.k.shape)} and {tuple(self.v.shape)}")
        if self.length > self.k.shape[1]:
            raise ValueError(f"a KV range of {self.length} tokens over a buffer of {self.k.shape[1]} slots")
        if self.k.stride() != self.v.stride() or self.k.stride(2) != 1 or self.k.stride(1) != self.k.shape[2]:
            raise ValueError("k and v must share strides, with head_dim contiguous and tokens head_dim apart")


@dataclass(slots=True)
class _Request:
    tokens: list[list[int]]  # query token lists (one per fork; one list for a plain sequence)
    shared: list[KVRange]  # ranges every list attends to (read once for all of them)
    own: list[list[KVRange]] = field(default_factory=list)  # per list: its own ranges
    fused: bool = True
    slot0: int = 0  # first partial slot (separate calls of the two-call form)


class _Layout:
    """A plan's host-side tables while they are built: segments (ranges), items (query rows x
    a slice of their ranges' keys), the packed token of every item row, and the partial slots
    each merged token has."""

    def __init__(self, plan: "AttentionPlan") -> None:
        self.plan = plan
        self.segs: list[list[int]] = []
        self.items: list[list[int]] = []
        self.qtok: list[int] = []
        self.slots: dict[int, int] = {}  # packed token -> partial slots written for it
        self.dtype: torch.dtype | None = None

    def add(self, req: _Request, seen: set[int]) -> None:
        tokens = [t for ts in req.tokens for t in ts]
        if not req.fused:  # one call of the unfused form: partials only, other calls share the tokens
            n = self.add_items(req.tokens, req.own[0], req.slot0, False)
            self.slots.update((t, max(self.slots.get(t, 0), req.slot0 + n)) for t in tokens)
            return
        dup = seen.intersection(tokens)
        if dup or len(set(tokens)) != len(tokens):
            raise ValueError(f"query tokens {sorted(dup)[:4]} are planned twice")
        seen.update(tokens)
        if sum(r.length for r in req.shared if r.length > 0) == 0:  # nothing shared: plain sequences
            for ts, own in zip(req.tokens, req.own):
                n = self.add_items([ts], own, 0, True)
                if n > 1:
                    self.slots.update((t, n) for t in ts)
            return
        n_shared = self.add_items(req.tokens, req.shared, 0, False)  # once, for every list's queries
        for ts, own in zip(req.tokens, req.own):
            n_own = self.add_items([ts], own, n_shared, False)
            self.slots.update((t, n_shared + n_own) for t in ts)

    def add_segments(self, ranges: list[KVRange]) -> tuple[int, int, int]:
        """Append the non-empty ranges; returns their index span and total keys."""
        lo, base = len(self.segs), 0
        for r in ranges:
            if r.length <= 0:
                continue
            if self.dtype is None:
                self.dtype = r.k.dtype
            elif r.k.dtype != self.dtype:
                raise ValueError(f"KV ranges of mixed dtypes {self.dtype} and {r.k.dtype}")
            diag = NO_DIAG if r.causal_start is None else r.causal_start
            self.segs.append([r.k.data_ptr(), r.v.data_ptr(), r.layer_stride, r.k.stride(0), r.k.stride(1),
                              r.length, diag, base, 0])
            base += r.length
        return lo, len(self.segs), base

    def add_items(self, token_lists: list[list[int]], ranges: list[KVRange], slot0: int, may_direct: bool) -> int:
        """Items for the stacked `token_lists` over `ranges`; returns the partial slots they take."""
        plan = self.plan
        seg_lo, seg_hi, total = self.add_segments(ranges)
        q_lo = len(self.qtok)
        self.qtok.extend(t for ts in token_lists for t in ts)
        n_q = len(self.qtok) - q_lo
        chunk = -(-max(total, 1) // plan._splits(total))
        if not plan.split_tokens:  # whole tiles per item
            chunk = -(-chunk // plan.block_n) * plan.block_n
        splits = max(1, -(-total // chunk))
        direct = int(may_direct and splits == 1)
        for s in range(splits):
            self.items.append([q_lo, n_q, seg_lo, seg_hi, s * chunk, min(total, (s + 1) * chunk), slot0 + s, direct])
        return splits


def device_programs(device: torch.device) -> int:
    """Programs that fill the device: twice its multiprocessor count on CUDA, 0 (never split) elsewhere."""
    if device.type != "cuda":
        return 0
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


class AttentionPlan:
    """Where every query row reads, built on the host once per step and run per layer.

    Add work with `sequence` (tokens over ranges, one fused pass), `forks` (several token lists
    over shared ranges plus their own) and `partial` (one range set into a given partial slot,
    for the two-call form); then `run(query, layer)` any number of times.

    `split_tokens` forces long ranges to be split into items of at most that many keys (tests
    use it to exercise the merge); by default a range is split only when the plan has fewer
    programs than `target_programs` (default: twice the multiprocessor count on CUDA).
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int, device: torch.device | str,
                 split_tokens: int | None = None, target_programs: int | None = None,
                 block_n: int | None = None, min_split: int = 256, block_m: int | None = None,
                 num_warps: int | None = None, num_stages: int = 2) -> None:
        if heads % kv_heads:
            raise ValueError(f"query heads {heads} not a multiple of kv heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.group = heads // kv_heads
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.split_tokens = split_tokens
        self.target_programs = device_programs(self.device) if target_programs is None else target_programs
        self.options = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps}
        self.num_stages = num_stages
        self.min_split = min_split
        self.requests: list[_Request] = []
        self._built = False
        self._partials: tuple[torch.Tensor, torch.Tensor] | None = None
        self._scratch: torch.Tensor | None = None  # the stand-in partial buffers of a plan without partials

    # ---- building ----------------------------------------------------------------------------

    def sequence(self, tokens, ranges: list[KVRange]) -> None:
        """Query tokens (indices into the packed query) over `ranges`, in one pass."""
        self._add(_Request([list(tokens)], [], [list(ranges)]))

    def forks(self, tokens: list, shared: list[KVRange], own: list[list[KVRange]]) -> None:
        """Several token lists over the same `shared` ranges (one pass over them for all the
        lists' stacked queries) plus each list's `own` ranges (typically its causal suffix)."""
        if len(tokens) != len(own):
            raise ValueError(f"{len(tokens)} token lists but {len(own)} own range lists")
        self._add(_Request([list(t) for t in tokens], list(shared), [list(o) for o in own]))

    def partial(self, tokens, ranges: list[KVRange], slot: int) -> None:
        """Tokens over `ranges` into partial slots from `slot` on (one per split; `n_slots`
        after `build` is one past the last): the building block of the unfused form, where
        each range is its own launch into shared partial buffers (`run(partials=...,
        merge=False)`) and the last plan's run merges every slot below its own end."""
        self._add(_Request([list(tokens)], [], [list(ranges)], fused=False, slot0=slot))

    def _add(self, request: _Request) -> None:
        if self._built:
            raise RuntimeError("the plan is already built")
        for r in request.shared + [r for own in request.own for r in own]:
            if r.k.shape[0] != self.kv_heads or r.k.shape[2] != self.head_dim:
                raise ValueError(f"a KV range of shape {tuple(r.k.shape)} in a plan for {self.kv_heads} kv heads "
                                 f"of {self.head_dim}")
            if r.k.device != self.device:
                raise ValueError(f"a KV range on {r.k.device} in a plan for {self.device}")
        self.requests.append(request)

    def _m_tiles(self, n_q: int, block_m: int) -> int:
        return -(-n_q * self.group // block_m)

    def build(self) -> None:
        """Lay out the tables (segments, items, tiles, merge list) and move them to the device."""
        if self._built:
            return
        self._built = True
        rows = [sum(len(t) for t in r.tokens) * self.group for r in self.requests]  # stacked forks count whole
        self.block_m = self.options["block_m"] or (16 if max(rows, default=1) <= 16 else 64)
        self.block_n, self.num_warps = self._tiles(self.block_m, self._dtype())
        self._base_programs = max(1, self.kv_heads * sum(-(-n // self.block_m) for n in rows))
        layout = _Layout(self)
        seen: set[int] = set()
        for req in self.requests:
            layout.add(req, seen)
        self.dtype = layout.dtype
        elem = self.dtype.itemsize if self.dtype is not None else 1
        self.aligned = (self.head_dim * elem) % 16 == 0 and all(
            seg[0] % 16 == 0 and seg[1] % 16 == 0 and (seg[2] * elem) % 16 == 0 and (seg[3] * elem) % 16 == 0
            for seg in layout.segs)
        tiles = [[i, m] for i, it in enumerate(layout.items) for m in range(self._m_tiles(it[1], self.block_m))]
        merge = sorted(layout.slots.items())
        self.n_segments, self.n_items = len(layout.segs), len(layout.items)
        self.n_tiles, self.n_merge = len(tiles), len(merge)
        self.n_slots = max(layout.slots.values(), default=0)

        def table(rows: list, empty: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(rows or empty, dtype=dtype).to(self.device)

        self.seg = table(layout.segs, [[0] * SEG_FIELDS], torch.int64)
        self.item = table(layout.items, [[0] * ITEM_FIELDS], torch.int64)
        self.qtok = table(layout.qtok, [0], torch.int32)
        self.tile = table(tiles, [[0, 0]], torch.int32)
        self.merge_tok = table([t for t, _ in merge], [0], torch.int32)
        self.merge_slots = table([n for _, n in merge], [0], torch.int32)

    def _dtype(self) -> torch.dtype | None:
        return next((r.k.dtype for req in self.requests for r in req.shared + [r for o in req.own for r in o]
                     if r.length > 0), None)

    def _tiles(self, block_m: int, dtype: torch.dtype | None) -> tuple[int, int]:
        """(BLOCK_N, num_warps) unless given. fp32 caches take IEEE dot products on the FMA units,
        and prefill tiles of 64 rows x 64 keys in fp32 do not fit 4 warps' registers: on an H200
        (9 heads of 64, 3 kv heads, against torch SDPA) a 150-token chunk over 3,400 keys took
        2,576 us with 64-key tiles on 4 warps, 144 us with 32-key tiles on 8 (SDPA 435 us); over
        800 keys 1,383 and 87 us (SDPA 111); 600 tokens over 8,000 keys 17,975 and 1,458 us (SDPA
        1,026). Decode rows (16-row tiles) and half-precision caches (tensor cores) keep 64-key
        tiles on 4 warps: a bf16 chunk of 150 over 3,400 keys 103 us (SDPA 90 us)."""
        block_n, warps = self.options["block_n"], self.options["num_warps"]
        if dtype == torch.float32 and block_m > 16:
            return block_n or 32, warps or 8
        return block_n or 64, warps or 4

    def _splits(self, total: int) -> int:
        """How many items one sequence's `total` keys are cut into: enough to give the device
        `target_programs` programs, each at least `min_split` keys; at most MERGE_SLOTS / 2 (32),
        so a fork's shared and own parts together merge in the one compiled variant."""
        if total <= 0:
            return 1
        if self.split_tokens:
            return max(1, -(-total // self.split_tokens))
        if not self.target_programs or total < 2 * self.min_split or self._base_programs >= self.target_programs:
            return 1
        return max(1, min(-(-self.target_programs // self._base_programs), total // self.min_split,
                          MERGE_SLOTS // 2))

    # ---- running -----------------------------------------------------------------------------

    def run(self, query: torch.Tensor, layer: int = 0, out: torch.Tensor | None = None,
            scaling: float | None = None, return_lse: bool = False,
            partials: tuple[torch.Tensor, torch.Tensor] | None = None, merge: bool = True):
        """Attention for the packed `query` `[tokens, heads, head_dim]` at `layer`.

        Returns `out` `[tokens, heads, head_dim]` (rows of tokens not in the plan untouched),
        and with `return_lse` also the merged log-sum-exp `[merged tokens, heads]` of the
        tokens that went through the merge (in the order of `self.merge_tok`). `partials`:
        fp32 buffers `[slots, tokens, heads, d]` and `[slots, tokens, heads]` to write partial
        results into (shared between plans in the unfused form); `merge=False` leaves them
        unmerged."""
        self.build()
        tokens, heads, dim = query.shape
        if heads != self.heads or dim != self.head_dim:
            raise ValueError(f"query of shape {tuple(query.shape)} for a plan of {self.heads} heads of {self.head_dim}")
        if query.stride(2) != 1:
            raise ValueError("query head_dim must be contiguous")
        if self.dtype is not None and query.dtype != self.dtype:
            raise ValueError(f"query dtype {query.dtype} differs from the cache dtype {self.dtype}")
        if query.device != self.device:
            raise ValueError(f"query on {query.device}, plan on {self.device}")
        if out is None:
            out = query.new_empty((tokens, heads, dim))
        scale = dim ** -0.5 if scaling is None else scaling
        if partials is not None:
            op, lp = partials
            if op.shape[0] < self.n_slots or op.shape[1] < tokens or lp.shape[:2] != op.shape[:2]:
                raise ValueError(f"partial buffers of {tuple(op.shape)} for {self.n_slots} slots of {tokens} tokens")
        elif self.n_slots:
            op, lp = self._partial_buffers(tokens)
        else:  # never touched (every item writes the output), but fp32 like real partials: one signature
            if self._scratch is None:
                self._scratch = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=query.device)
            op, lp = self._scratch, self._scratch[0, :, :, 0]
        block_d = max(16, triton.next_power_of_2(dim))
        if self.n_tiles:
            _attention_kernel[(self.n_tiles, self.kv_heads)](
                query, out, op, lp, self.seg, self.item, self.qtok, self.tile, layer, scale * LOG2E,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                op.stride(0), op.stride(1), op.stride(2), lp.stride(0), lp.stride(1),
                G=self.group, D=dim, BLOCK_D=block_d, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                IEEE=query.dtype == torch.float32, UPCAST=query.dtype == torch.bfloat16 and _INTERPRETED,
                ALIGNED=self.aligned,
                num_warps=self.num_warps, num_stages=self.num_stages)
        lse = None
        if self.n_merge and merge:
            block_s = max(MERGE_SLOTS, triton.next_power_of_2(self.n_slots))  # one variant up to 64 slots
            lse = torch.empty((self.n_merge, heads), dtype=torch.float32, device=query.device) if return_lse else out
            _merge_kernel[(self.n_merge, heads)](
                out, op, lp, self.merge_tok, self.merge_slots, lse,
                out.stride(0), out.stride(1), op.stride(0), op.stride(1), op.stride(2), lp.stride(0), lp.stride(1),
                D=dim, BLOCK_D=block_d, BLOCK_S=block_s, WRITE_LSE=return_lse,
                num_warps=4)
        return (out, lse) if return_lse else out

    def _partial_buffers(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 partial outputs and log-sum-exps, `[slots, tokens, heads, d]` and `[slots, tokens, heads]`,
        kept for the plan's layers (one stream: a layer's merge runs before the next writes)."""
        bufs = self._partials
        if bufs is None or bufs[0].shape[1] < tokens:
            bufs = (torch.empty((self.n_slots, tokens, self.heads, self.head_dim), dtype=torch.float32,
                                device=self.device),
                    torch.empty((self.n_slots, tokens, self.heads), dtype=torch.float32, device=self.device))
            self._partials = bufs
        return bufs


def warm_up(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """Compile the kernel variants a model's steps use, before the first step needs them: the
    attention kernel for decode tiles (BLOCK_M 16) and for prefill tiles (BLOCK_M 64), and the
    merge (whether an item writes the output or a partial is decided at run time, in the same
    binary). Runs a small plan of each over a scratch cache of the model's head shape and dtype,
    cut into items so the merge runs too; returns how many plans ran. Compiled binaries also go
    to Triton's on-disk cache, so a restarted process loads them."""
    device = torch.device(device)
    keys, split = 1024, 256
    k = torch.zeros((kv_heads, keys, head_dim), dtype=dtype, device=device)
    ran = 0
    for tokens in (1, 64):  # decode rows (one token per sequence), a prefill chunk
        plan = AttentionPlan(heads, kv_heads, head_dim, device, split_tokens=split)
        plan.sequence(range(tokens), [KVRange(k, k, keys - tokens, causal_start=keys - 2 * tokens)])
        plan.run(torch.zeros((tokens, heads, head_dim), dtype=dtype, device=device))
        ran += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ran


def compiled_variants() -> int:
    """How many binaries of the two kernels Triton holds in this process (0 when interpreted)."""
    return sum(len(cache[0]) for kernel in (_attention_kernel, _merge_kernel)
               for cache in getattr(kernel, "device_caches", {}).values())
