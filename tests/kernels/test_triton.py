"""The fused Triton kernels against the pure-torch reference, run under TRITON_INTERPRET=1.

Caches are laid out as the pool lays them out: one storage tensor
`[layers, 2, kv_heads, slots, d]` holding extents (a session's own blocks, a shared prefix's
blocks) at scattered offsets, plus private buffers for forks; kernels read them in place.
Slots outside every valid range hold huge values, so a read past a range shows.
"""

import pytest
import torch
from streamer.kernels.reference import _partial_attention, cache_attention, forked_attention, ranges_attention
from streamer.kernels.triton_attention import AttentionPlan, KVRange
from testdevice import DEVICE

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
LAYERS = 3
LAYER = 2  # kernels address layer 0 plus a stride: test a later layer
pytestmark = pytest.mark.usefixtures("kernel_device")  # tensors made without a device land on DEVICE


def seeded(shape, g):
    """Seeded normal values (drawn on the CPU, so the same on every device) on the test's device."""
    return torch.randn(shape, generator=g, device="cpu").to(DEVICE)


class Storage:
    """A pool-shaped tensor handing out extents (with a gap of poison between them)."""

    def __init__(self, kv_heads, dim, slots=2048, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.full((LAYERS, 2, kv_heads, slots, dim), 1e4).to(dtype)
        self.cursor = 7  # extents start off any alignment
        self.g = g

    def extent(self, length, capacity=None):
        capacity = capacity or length + 5
        start = self.cursor
        self.cursor += capacity + 11
        assert self.cursor <= self.data.shape[3]
        sl = slice(start, start + capacity)
        self.data[:, :, :, start:start + length] = seeded(
            self.data[:, :, :, start:start + length].shape, self.g).to(self.data.dtype)
        return sl

    def range(self, sl, length, causal_start=None):
        k, v = self.data[0, 0, :, sl], self.data[0, 1, :, sl]
        return KVRange(k, v, length, causal_start, self.data.stride(0))

    def layer(self, sl, layer=LAYER):
        return self.data[layer, 0, :, sl].float(), self.data[layer, 1, :, sl].float()


def queries(tokens, heads, dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return seeded((tokens, heads, dim), g).to(dtype)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("split", [None, 32])
def test_decode_batch_over_ragged_paged_caches(dtype, kv_heads, group, split):
    """One new token per session, ragged lengths across block boundaries, some sessions on a
    shared prefix extent; one launch for all of them (plus a merge when split)."""
    dim = 16
    st = Storage(kv_heads, dim, dtype=dtype, seed=kv_heads * 10 + group)
    prefix = st.extent(32)
    lengths = [1, 17, 63, 64, 65, 130]
    shared = [False, True, False, True, False, True]
    q = queries(len(lengths), kv_heads * group, dim, dtype)
    plan = AttentionPlan(kv_heads * group, kv_heads, dim, DEVICE, split_tokens=split, block_n=16)
    own = []
    for i, (length, sh) in enumerate(zip(lengths, shared)):
        own_len = length
        ranges = [st.range(prefix, 32)] if sh else []
        sl = st.extent(own_len)
        own.append(sl)
        ranges.append(st.range(sl, own_len, causal_start=own_len - 1))
        plan.sequence([i], ranges)
    out = plan.run(q, LAYER)
    for i, (length, sh) in enumerate(zip(lengths, shared)):
        k, v = st.layer(own[i])
        qi = q[i:i + 1].transpose(0, 1).float()
        if sh:
            pk, pv = st.layer(prefix)
            expected = ranges_attention(qi, [(pk, pv, 32)], k, v, length - 1)
        else:
            expected = cache_attention(qi, k, v, length - 1)
        close(out[i:i + 1], expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 4), (2, 3)])
def test_chunked_prefill_several_sessions_per_launch(dtype, kv_heads, group):
    """A chunk of new tokens over each session's cache, causal inside the chunk: empty caches
    (square causal), caches ending on and off block boundaries, single- and multi-token chunks."""
    dim = 32
    st = Storage(kv_heads, dim, dtype=dtype, seed=group)
    cases = [(0, 1), (0, 23), (5, 40), (64, 7), (100, 70), (3, 1)]  # (cached, new)
    total = sum(n for _, n in cases)
    q = queries(total, kv_heads * group, dim, dtype, seed=3)
    plan = AttentionPlan(kv_heads * group, kv_heads, dim, DEVICE)
    offset, extents = 0, []
    for start, n in cases:
        sl = st.extent(start + n)
        extents.append(sl)
        plan.sequence(range(offset, offset + n), [st.range(sl, start + n, causal_start=start)])
        offset += n
    out = plan.run(q, LAYER)
    assert plan.block_m == 64  # the long chunks take the large tile
    offset = 0
    for (start, n), sl in zip(cases, extents):
        k, v = st.layer(sl)
        expected = cache_attention(q[offset:offset + n].transpose(0, 1).float(), k, v, start)
        close(out[offset:offset + n], expected, dtype)
        offset += n


@pytest.mark.parametrize("visible,shared", [(0, False), (100, False), (48, True), (32, True)])
@pytest.mark.parametrize("thought,n", [(0, 1), (70, 1), (0, 3), (9, 4)])
@pytest.mark.parametrize("split", [None, 16])
def test_two_range_dual_thinking(visible, shared, thought, n, split):
    """A reasoning step attends to reading[0:visible) (a shared-prefix extent and the
    session's own extent) and thinking[0:thought + n), offset-causal, in one fused pass;
    thinking may be empty (the first unit) and so may the reading range."""
    kv_heads, group, dim, dtype = 2, 2, 16, torch.float32
    st = Storage(kv_heads, dim, dtype=dtype, seed=visible + thought)
    ranges, ref_ranges = [], []
    if shared:
        prefix = st.extent(32)
        ranges.append(st.range(prefix, 32))
        ref_ranges.append((*st.layer(prefix), 32))
    own_len = visible - (32 if shared else 0)
    if own_len > 0:
        reading = st.extent(own_len)
        ranges.append(st.range(reading, own_len))
        ref_ranges.append((*st.layer(reading), own_len))
    thinking = torch.randn(LAYERS, 2, kv_heads, thought + n + 8, dim)  # a private buffer, as the thinking cache
    thinking[:, :, :, thought + n:] = 1e4
    ranges.append(KVRange(thinking[0, 0], thinking[0, 1], thought + n, thought, thinking.stride(0)))
    q = queries(n, kv_heads * group, dim, dtype, seed=n)
    plan = AttentionPlan(kv_heads * group, kv_heads, dim, DEVICE, split_tokens=split, block_n=32)
    plan.sequence(range(n), ranges)
    out = plan.run(q, LAYER)
    expected = ranges_attention(q.transpose(0, 1), ref_ranges, thinking[LAYER, 0], thinking[LAYER, 1], thought)
    close(out, expected, dtype)
    assert plan.n_merge == (0 if split is None or visible + thought + n <= 16 else n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_len", [1, 37, 130])
@pytest.mark.parametrize("sizes", [[1, 1, 1], [3, 1, 7], [1] * 9])
def test_shared_prefix_forks_equal_forked_attention(dtype, prefix_len, sizes):
    """Many questions on one session: the prefix is one item for all the forks' stacked queries,
    each fork's suffix (its question and answer so far, at its own depth) another; merged."""
    kv_heads, group, dim = 2, 4, 16
    st = Storage(kv_heads, dim, dtype=dtype, seed=prefix_len)
    prefix = st.extent(prefix_len)
    total = sum(sizes)
    q = queries(total + 2, kv_heads * group, dim, dtype, seed=len(sizes))
    tokens, own, suffixes = [], [], []
    offset = 2  # the forks' tokens need not start the packed batch
    for i, n in enumerate(sizes):
        start = 2 * i
        buf = torch.randn(LAYERS, 2, kv_heads, start + n + 3, dim).to(dtype)
        tokens.append(list(range(offset, offset + n)))
        own.append([KVRange(buf[0, 0], buf[0, 1], start + n, start, buf.stride(0))])
        suffixes.append((buf[LAYER, 0].float(), buf[LAYER, 1].float(), start))
        offset += n
    plan = AttentionPlan(kv_heads * group, kv_heads, dim, DEVICE)
    plan.forks(tokens, [st.range(prefix, prefix_len)], own)
    out = plan.run(q, LAYER)
    pk, pv = st.layer(prefix)
    expected = forked_attention([q[t].transpose(0, 1).float() for t in tokens], [(pk, pv, prefix_len)], suffixes)
    for t, e in zip(tokens, expected):
        close(out[t], e, dtype)
    prefix_items = [it for it in plan.item.tolist() if it[2] == 0]
    assert len(prefix_items) == 1 and prefix_items[0][1] == total  # the prefix is read once, for all forks


def test_two_calls_and_merge_equal_the_fused_pass():
    """The unfused form (each range its own launch into shared partial buffers, then a merge)
    gives what the single fused pass gives, and the merged log-sum-exp is the reference's."""
    kv_heads, group, dim, n = 2, 2, 16, 3
    st = Storage(kv_heads, dim)
    a, b = st.extent(90), st.extent(40)
    ra, rb = st.range(a, 90), st.range(b, 40, causal_start=40 - n)
    q = queries(n, kv_heads * group, dim, torch.float32)
    fused = AttentionPlan(kv_heads * group, kv_heads, dim, DEVICE)
    fused.sequence(range(n), [ra, rb])
    expected = fused.run(q, LAYER)
    first = AttentionPlan(kv_heads * group, kv_heads, dim, DEVICE, split_tokens=32)  # 3 slots
    first.partial(range(n), [ra], slot=0)
    first.build()
    second = AttentionPlan(kv_heads * group, kv_heads, dim, DEVICE)
    second.partial(range(n), [rb], slot=first.n_slots)
    second.build()
    assert (first.n_slots, second.n_slots) == (3, 4)
    bufs = (torch.empty(4, n, kv_heads * group, dim), torch.empty(4, n, kv_heads * group))
    first.run(q, LAYER, partials=bufs, merge=False)
    out, lse = second.run(q, LAYER, partials=bufs, return_lse=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the merged lse is that of attention over both ranges, computed the textbook way
    ka, va = st.layer(a)
    kb, vb = st.layer(b)
    k = torch.cat([ka[:, :90], kb[:, :40]], 1)
    v = torch.cat([va[:, :90], vb[:, :40]], 1)
    mask = torch.ones(n, 130, dtype=torch.bool)
    mask[:, 90:] = torch.arange(40).unsqueeze(0) <= (40 - n + torch.arange(n)).unsqueeze(1)
    ref_out, ref_lse = _partial_attention(q.transpose(0, 1), k, v, mask, dim ** -0.5)
    torch.testing.assert_close(out, ref_out.transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_rows_outside_the_plan_are_untouched_and_scaling_is_honoured():
    kv_heads, dim = 1, 16
    st = Storage(kv_heads, dim)
    sl = st.extent(20)
    q = queries(3, 2, dim, torch.float32)
    out = torch.full((3, 2, dim), 7.0)
    plan = AttentionPlan(2, kv_heads, dim, DEVICE)
    plan.sequence([1], [st.range(sl, 20, causal_start=19)])
    plan.run(q, LAYER, out=out, scaling=0.3)
    assert (out[0] == 7).all() and (out[2] == 7).all()
    k, v = st.layer(sl)
    close(out[1:2], cache_attention(q[1:2].transpose(0, 1), k, v, 19, scaling=0.3), torch.float32)


def test_bad_plans_raise_clear_errors():
    st = Storage(2, 16)
    sl = st.extent(10)
    with pytest.raises(ValueError, match="not a multiple"):
        AttentionPlan(3, 2, 16, DEVICE)
    plan = AttentionPlan(4, 2, 16, DEVICE)
    with pytest.raises(ValueError, match="kv heads"):
        plan.sequence([0], [KVRange(torch.zeros(1, 10, 16), torch.zeros(1, 10, 16), 5)])
    with pytest.raises(ValueError, match="10 slots"):
        KVRange(torch.zeros(2, 10, 16), torch.zeros(2, 10, 16), 11)
    plan.sequence([0], [st.range(sl, 10, causal_start=9)])
    plan.sequence([0], [st.range(sl, 10, causal_start=9)])
    with pytest.raises(ValueError, match="planned twice"):
        plan.build()
    plan = AttentionPlan(4, 2, 16, DEVICE)
    plan.sequence([0], [st.range(sl, 10, causal_start=9)])
    with pytest.raises(ValueError, match="dtype"):
        plan.run(torch.zeros(1, 4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="heads"):
        plan.run(torch.zeros(1, 2, 16))
