import pytest
import torch

from streamer.kernels import cache_attention, causal_offset_mask


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
