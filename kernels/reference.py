"""Pure-torch attention of new tokens over a session's KV cache.

A session's cache for one layer is a pair of buffers `[kv_heads, capacity, head_dim]`. A step
writes `n` new keys/values at positions `[start, start + n)` and then every new query attends
to keys `[0, start + i]` (causal with an offset). SDPA's `is_causal` aligns the triangle
top-left when there are fewer queries than keys, which is wrong here, so the mask is explicit.

Grouped-query attention is computed without `repeat_kv` (SDPA's `enable_gqa`), so keys and
values are read in place from the cache buffers, never copied or expanded. On CPU this is
also about 3x faster for multi-token steps than folding the query group into the length,
because the fused kernel parallelises over all query heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_offset_mask(n: int, start: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean mask `[n, start + n]`: query i may see key j iff j <= start + i."""
    rows = torch.arange(n, device=device).unsqueeze(1) + start
    cols = torch.arange(start + n, device=device).unsqueeze(0)
    return cols <= rows


def cache_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attend `n` new queries to a cache whose first `start + n` slots are valid.

    Args:
        query: `[heads, n, head_dim]`, positions `start .. start + n - 1`.
        k_cache, v_cache: `[kv_heads, capacity, head_dim]`; slots `[0, start + n)` are valid and
            already hold the new tokens' keys and values.
        start: number of cached tokens before the new ones.
        scaling: softmax scale (defaults to `head_dim ** -0.5`).

    Returns:
        `[n, heads, head_dim]`.
    """
    heads, n, dim = query.shape
    kv_heads = k_cache.shape[0]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} not a multiple of kv heads {kv_heads}")
    total = start + n
    if total > k_cache.shape[1]:
        raise ValueError(f"cache holds {k_cache.shape[1]} slots, attention needs {total}")
    k = k_cache[:, :total].unsqueeze(0)
    v = v_cache[:, :total].unsqueeze(0)
    # A square causal block (empty cache) is exactly is_causal, which lets the fused kernel skip
    # the masked half; with cached tokens before the block the mask must be explicit.
    square = start == 0 and n > 1
    mask = causal_offset_mask(n, start, query.device) if n > 1 and not square else None
    out = F.scaled_dot_product_attention(query.unsqueeze(0), k, v, attn_mask=mask, scale=scaling,
                                         is_causal=square, enable_gqa=heads != kv_heads)
    return out[0].transpose(0, 1)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one key range, with its log-sum-exp for merging.

    q: `[heads, n, d]`; k, v: `[kv_heads, t, d]`; mask: `[n, t]` bool or None.
    Returns out `[heads, n, d]` and lse `[heads, n]` (-inf rows where nothing is visible).
    """
    heads, n, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    qf = q.reshape(kv_heads, group * n, dim)
    if mask is None and _CPU_FLASH is not None and q.device.type == "cpu" and k.shape[1] > 0:
        # Unmasked: torch's fused CPU kernel, which also returns the log-sum-exp. With no mask
        # the query group folds into the length, so kv heads are read in place, never expanded.
        out, lse = _CPU_FLASH(qf.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=scaling)[:2]
        return out[0].reshape(heads, n, dim), lse[0].reshape(heads, n)
    scores = torch.matmul(qf, k.transpose(1, 2)).mul_(scaling)
    if mask is not None:
        scores.masked_fill_(~mask.repeat(group, 1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).nan_to_num_(0.0)  # rows that see nothing contribute nothing
    out = torch.matmul(probs, v)
    return out.reshape(heads, n, dim), lse.reshape(heads, n)


def _causal_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Square causal attention of `n` new queries over their own `n` keys, with its lse."""
    heads, n, dim = q.shape
    group = heads // k.shape[0]
    if _CPU_FLASH is not None and q.device.type == "cpu":
        ke = k.repeat_interleave(group, dim=0) if group > 1 else k  # n keys only: cheap to expand
        ve = v.repeat_interleave(group, dim=0) if group > 1 else v
        out, lse = _CPU_FLASH(q.unsqueeze(0), ke.unsqueeze(0), ve.unsqueeze(0), is_causal=True, scale=scaling)[:2]
        return out[0], lse[0]
    return _partial_attention(q, k, v, causal_offset_mask(n, 0, q.device), scaling)


def ranges_attention(
    query: torch.Tensor,
    ranges: list[tuple[torch.Tensor, torch.Tensor, int]],
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    own_start: int,
    scaling: float | None = None,
    own_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """New queries of one sequence over read-only ranges (a shared system-prompt prefix, say)
    plus its own cache, whose slots `[0, own_start)` are cached and `[own_start, own_start+n)`
    hold the new tokens. Each part runs through a fused kernel and the parts are merged by
    log-sum-exp, so a long own cache is read in place, with no copy and no materialised scores.
    `own_bias` (`own_causal_bias` with `before` = the ranges' length) makes it one masked call
    over the ranges and the own cache gathered (short caches, where calls cost more than copies).

    Returns `[n, heads, d]`.
    """
    heads, n, dim = query.shape
    scale = dim ** -0.5 if scaling is None else scaling
    ranges = [(k, v, length) for k, v, length in ranges if length > 0]
    if own_bias is not None and ranges:
        end = own_start + n
        k = torch.cat([k[:, :length] for k, _, length in ranges] + [own_k[:, :end]], dim=1)
        v = torch.cat([v[:, :length] for _, v, length in ranges] + [own_v[:, :end]], dim=1)
        (out, _), = own_partials(query, k, v, k.shape[1] - n, scale, own_bias)
        return out.transpose(0, 1)
    parts = [_partial_attention(query, k[:, :length], v[:, :length], None, scale) for k, v, length in ranges]
    parts.extend(own_partials(query, own_k, own_v, own_start, scale, own_bias))
    if len(parts) == 1:
        return parts[0][0].transpose(0, 1)
    return merge_partials(parts).transpose(0, 1)


OWN_BIAS_MAX = 1 << 20  # elements of a masked call's bias up to which it replaces the split calls


def own_causal_bias(heads: int, kv_heads: int, n: int, start: int, dtype: torch.dtype,
                    device: torch.device, before: int = 0) -> torch.Tensor | None:
    """The additive mask of `n` new queries over `before` read-only keys (all visible) and an
    own cache of `start + n` keys (offset-causal), rows laid out as the folded query group:
    `[1, 1, group * n, before + start + n]`. Built once per step and shared by every layer.
    None where one masked call is not the faster way (a decode row needs no mask; a long cache
    or chunk would make the mask large) or the fused CPU kernel is missing. Depends on the
    sequence alone, so a sequence computes the same whatever else is in its step."""
    group = heads // kv_heads
    keys = before + start + n
    if n <= 1 or _CPU_FLASH is None or torch.device(device).type != "cpu" or group * n * keys > OWN_BIAS_MAX:
        return None
    rows = (torch.arange(group * n, device=device) % n).unsqueeze(1) + (before + start)  # row g*n + i is token i
    hidden = torch.arange(keys, device=device).unsqueeze(0) > rows
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))[None, None]


def own_partials(query: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, own_start: int, scale: float,
                 own_bias: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The new queries over their own cache (cached slots, then their own keys causally), as
    `(out, lse)` parts: one call with `own_bias`, else the cached part and the causal block."""
    n = query.shape[1]
    end = own_start + n
    if n == 1:  # decode: the one new query sees its whole own cache, itself included: no mask
        return [_partial_attention(query, own_k[:, :end], own_v[:, :end], None, scale)]
    if own_bias is not None:
        heads, _, dim = query.shape
        kv_heads = own_k.shape[0]
        qf = query.reshape(kv_heads, heads // kv_heads * n, dim)
        out, lse = _CPU_FLASH(qf[None], own_k[None, :, :end], own_v[None, :, :end], attn_mask=own_bias,
                              scale=scale)[:2]
        return [(out[0].reshape(heads, n, dim), lse[0].reshape(heads, n))]
    parts = []
    if own_start > 0:
        parts.append(_partial_attention(query, own_k[:, :own_start], own_v[:, :own_start], None, scale))
    parts.append(_causal_partial(query, own_k[:, own_start:end], own_v[:, own_start:end], scale))
    return parts


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine attention computed over disjoint key ranges by their log-sum-exps. The last part
    must see a key in every row (a sequence's own part: each token sees itself)."""
    if len(parts) == 2:  # the usual case (one shared prefix, own cache): w = exp(l0) / (exp(l0) + exp(l1))
        (o0, l0), (o1, l1) = parts
        w = torch.sigmoid(l0 - l1).unsqueeze(-1)
        return torch.lerp(o1, o0, w)
    lse = torch.stack([p[1] for p in parts])  # [ranges, heads, n]
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total).nan_to_num_(0.0)
    return sum(w.unsqueeze(-1) * p[0] for w, p in zip(weights, parts))


def forked_attention(
    queries: list[torch.Tensor],
    prefixes: list[tuple[torch.Tensor, torch.Tensor, int]],
    suffixes: list[tuple[torch.Tensor, torch.Tensor, int]],
    scaling: float | None = None,
) -> list[torch.Tensor]:
    """Several forks that share read-only key ranges: each fork's new queries attend to every
    shared range in full and to its own suffix cache, causally.

    A shared range is, for example, a session's reading cache `[0, visible)` or its thinking
    cache. Each one is read once for all forks: their queries are stacked into one call against
    it. The suffixes (short: a question and its answer so far) are padded into one batch and
    attended together. All parts are merged by log-sum-exp, which equals one attention over
    `ranges + suffix` with the offset-causal mask on the suffix.

    Args:
        queries: per fork `[heads, n_i, d]`.
        prefixes: shared `(k_cache, v_cache, length)`, caches `[kv_heads, capacity, d]`.
        suffixes: per fork `(k_cache, v_cache, start)`: slots `[0, start + n_i)` valid, the new
            tokens at `[start, start + n_i)`.

    Returns:
        per fork `[n_i, heads, d]`.
    """
    if len(queries) != len(suffixes):
        raise ValueError(f"{len(queries)} query blocks but {len(suffixes)} suffix caches")
    dim = queries[0].shape[-1]
    scale = dim ** -0.5 if scaling is None else scaling
    sizes = [q.shape[1] for q in queries]
    own_out, own_lse = _padded_suffix_attention(queries, suffixes, scale)
    own = [(own_out[i, :, :n], own_lse[i, :, :n]) for i, n in enumerate(sizes)]
    live = [(k, v, length) for k, v, length in prefixes if length > 0]
    if not live:
        return [o.transpose(0, 1) for o, _ in own]
    stacked = torch.cat(queries, dim=1) if len(queries) > 1 else queries[0]
    shared = []
    for k, v, length in live:
        out, lse = _partial_attention(stacked, k[:, :length], v[:, :length], None, scale)
        shared.append(list(zip(out.split(sizes, dim=1), lse.split(sizes, dim=1))))
    return [merge_partials([part[i] for part in shared] + [own[i]]).transpose(0, 1) for i in range(len(queries))]


def _padded_suffix_attention(queries: list[torch.Tensor], suffixes: list[tuple[torch.Tensor, torch.Tensor, int]],
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each fork's queries over its own suffix, causally, as one padded batch.
    Returns out `[forks, heads, n_max, d]` and lse `[forks, heads, n_max]`."""
    forks = len(queries)
    heads, _, dim = queries[0].shape
    kv_heads = suffixes[0][0].shape[0]
    group = heads // kv_heads
    sizes = [q.shape[1] for q in queries]
    n_max = max(sizes)
    lengths = [start + n for (_, _, start), n in zip(suffixes, sizes)]
    l_max = max(lengths)
    q = queries[0].new_zeros(forks, heads, n_max, dim)
    k = queries[0].new_zeros(forks, kv_heads, l_max, dim)
    v = queries[0].new_zeros(forks, kv_heads, l_max, dim)
    for i, (query, (kc, vc, _)) in enumerate(zip(queries, suffixes)):
        q[i, :, :sizes[i]] = query
        k[i, :, :lengths[i]] = kc[:, :lengths[i]]
        v[i, :, :lengths[i]] = vc[:, :lengths[i]]
    device = q.device
    starts = torch.tensor([start for _, _, start in suffixes], device=device).view(forks, 1, 1)
    rows = torch.arange(n_max, device=device).view(1, n_max, 1)
    cols = torch.arange(l_max, device=device).view(1, 1, l_max)
    visible = cols <= starts + rows  # [forks, n_max, l_max]; padded rows see their own prefix only
    scores = torch.matmul(q.view(forks, kv_heads, group * n_max, dim), k.transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~visible.repeat(1, group, 1).unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.exp(scores - lse), v)
    return out.view(forks, heads, n_max, dim), lse.view(forks, heads, n_max)
