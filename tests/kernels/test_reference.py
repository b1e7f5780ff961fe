import pytest
import torch

from streamer.kernels import cache_attention, causal_offset_mask, forked_attention, merge_partials, ranges_attention
from streamer.kernels.reference import OWN_BIAS_MAX, own_causal_bias


def naive(query, k, v, start, scaling):
    """Attention the textbook way: expand kv heads, full score matrix, explicit mask."""
    heads, n, dim = query.shape
    group = heads // k.shape[0]
    total = start + n
    k = k[:, :total].repeat_interleave(group, dim=0)
    v = v[:, :total].repeat_interleave(group, dim=0)
    scores = query @ k.transpose(1, 2) * scaling
    allowed = torch.tensor([[j <= start + i for j in range(total)] for i in range(n)])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 2), (3, 3), (1, 8)])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 7), (5, 1), (13, 4), (100, 33)])
def test_cache_attention_matches_naive(kv_heads, group, start, n):
    torch.manual_seed(start * 31 + n)
    dim, capacity = 16, start + n + 9  # spare capacity past the valid slots holds garbage
    q = torch.randn(kv_heads * group, n, dim)
    k = torch.randn(kv_heads, capacity, dim)
    v = torch.randn(kv_heads, capacity, dim)
    k[:, start + n:] = 1e4  # must never be read
    out = cache_attention(q, k, v, start, dim ** -0.5)
    assert out.shape == (n, kv_heads * group, dim)
    torch.testing.assert_close(out, naive(q, k, v, start, dim ** -0.5), atol=1e-5, rtol=1e-5)


def test_mask_is_offset_causal():
    mask = causal_offset_mask(2, 3)
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="not a multiple"):
        cache_attention(torch.randn(3, 1, 4), torch.randn(2, 4, 4), torch.randn(2, 4, 4), 0)
    with pytest.raises(ValueError, match="cache holds 4 slots"):
        cache_attention(torch.randn(2, 2, 4), torch.randn(2, 4, 4), torch.randn(2, 4, 4), 3)


@pytest.mark.parametrize("prefix_len", [0, 1, 37])
@pytest.mark.parametrize("sizes", [[1], [5], [1, 1, 1], [3, 1, 7]])
def test_forked_attention_equals_attention_over_the_concatenation(prefix_len, sizes):
    torch.manual_seed(prefix_len + sum(sizes))
    kv_heads, group, dim = 2, 3, 8
    prefix_k = torch.randn(kv_heads, prefix_len + 5, dim)
    prefix_v = torch.randn_like(prefix_k)
    queries, suffixes, expected = [], [], []
    for i, n in enumerate(sizes):
        start = i  # forks at different depths of their own suffix
        k = torch.randn(kv_heads, start + n + 3, dim)
        v = torch.randn_like(k)
        q = torch.randn(kv_heads * group, n, dim)
        queries.append(q)
        suffixes.append((k, v, start))
        full_k = torch.cat([prefix_k[:, :prefix_len], k[:, :start + n]], dim=1)
        full_v = torch.cat([prefix_v[:, :prefix_len], v[:, :start + n]], dim=1)
        expected.append(naive(q, full_k, full_v, prefix_len + start, dim ** -0.5))
    got = forked_attention(queries, [(prefix_k, prefix_v, prefix_len)], suffixes, dim ** -0.5)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_merge_partials_ignores_empty_ranges():
    out = torch.randn(2, 3, 4)
    empty = (torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf")))
    torch.testing.assert_close(merge_partials([(out, torch.zeros(2, 3)), empty]), out)


def test_forked_attention_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="2 query blocks but 1 suffix"):
        forked_attention([torch.randn(2, 1, 4)] * 2, [(torch.randn(1, 4, 4), torch.randn(1, 4, 4), 2)],
                         [(torch.randn(1, 4, 4), torch.randn(1, 4, 4), 0)])


@pytest.mark.parametrize("lengths", [[0, 6], [9, 0], [9, 6], [1, 1]])
def test_two_shared_ranges_equal_attention_over_the_concatenation(lengths):
    """Reading range + thinking range + the fork's own tokens (dual-cache decoding)."""
    torch.manual_seed(sum(lengths))
    kv_heads, group, dim = 3, 3, 8
    ranges = [(torch.randn(kv_heads, n + 4, dim), torch.randn(kv_heads, n + 4, dim), n) for n in lengths]
    k = torch.randn(kv_heads, 7, dim)
    v = torch.randn_like(k)
    q = torch.randn(kv_heads * group, 3, dim)
    got = forked_attention([q], ranges, [(k, v, 2)], dim ** -0.5)[0]
    full_k = torch.cat([rk[:, :n] for rk, _, n in ranges] + [k[:, :5]], dim=1)
    full_v = torch.cat([rv[:, :n] for _, rv, n in ranges] + [v[:, :5]], dim=1)
    torch.testing.assert_close(got, naive(q, full_k, full_v, sum(lengths) + 2, dim ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shared,own_start,n", [(0, 0, 1), (16, 0, 5), (16, 40, 1), (32, 40, 7), (0, 9, 3)])
def test_ranges_attention_equals_attention_over_the_concatenation(shared, own_start, n, masked):
    """A session whose cache starts with a shared system-prompt prefix: split into fused calls
    merged by log-sum-exp, or (masked) one call over the gathered keys under `own_causal_bias`."""
    torch.manual_seed(shared + own_start + n)
    kv_heads, group, dim = 3, 3, 16
    pk, pv = torch.randn(kv_heads, shared + 3, dim), torch.randn(kv_heads, shared + 3, dim)
    k, v = torch.randn(kv_heads, own_start + n + 4, dim), torch.randn(kv_heads, own_start + n + 4, dim)
    q = torch.randn(kv_heads * group, n, dim)
    bias = own_causal_bias(kv_heads * group, kv_heads, n, own_start, q.dtype, q.device, before=shared) if masked \
        else None
    assert (bias is not None) == (masked and n > 1)  # a decode row needs no mask
    got = ranges_attention(q, [(pk, pv, shared)], k, v, own_start, dim ** -0.5, bias)
    full_k = torch.cat([pk[:, :shared], k[:, :own_start + n]], dim=1)
    full_v = torch.cat([pv[:, :shared], v[:, :own_start + n]], dim=1)
    torch.testing.assert_close(got, naive(q, full_k, full_v, shared + own_start, dim ** -0.5), atol=1e-5, rtol=1e-5)


def test_own_causal_bias_is_the_folded_offset_causal_mask_and_stays_small():
    bias = own_causal_bias(4, 2, 3, 2, torch.float32, torch.device("cpu"), before=1)[0, 0]
    visible = torch.cat([torch.ones(3, 1, dtype=torch.bool), causal_offset_mask(3, 2)], dim=1)
    assert torch.equal(bias == 0, visible.repeat(2, 1))  # row g * n + i is query i of group member g
    assert own_causal_bias(4, 2, 1, 100, torch.float32, torch.device("cpu")) is None  # decode: no mask
    n = 512
    assert own_causal_bias(6, 2, n, OWN_BIAS_MAX // (3 * n), torch.float32, torch.device("cpu")) is None


def test_two_part_merge_equals_the_general_merge():
    torch.manual_seed(5)
    parts = [(torch.randn(3, 4, 8), torch.randn(3, 4) * 4) for _ in range(2)]
    lse = torch.stack([p[1] for p in parts])
    weights = torch.exp(lse - torch.logsumexp(lse, dim=0))
    torch.testing.assert_close(merge_partials(parts), sum(w.unsqueeze(-1) * p[0] for w, p in zip(weights, parts)))
