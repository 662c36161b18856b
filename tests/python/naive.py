"""PyTorch's own attention written naively in float64: the reference the Python tests compare against."""

import torch


def attention(q, k, v, causal=True, segment_ids=None, scale=None, window=None, softcap=None, sinks=None):
    """q [B, S, Hq, D], k and v [B, S, Hkv, D] (any float dtype, computed in it); GQA by repeating K/V.
    window: LEFT or (LEFT, RIGHT), flash-attention's window_size: query i sees keys i-LEFT..i+RIGHT.
    softcap: logits x become softcap * tanh(x / softcap) (Gemma 2). sinks [Hq]: one more logit per head in the
    softmax's denominator, with no value (gpt-oss)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, 2)
    v = v.repeat_interleave(group, 2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    n = q.shape[1]
    visible = torch.ones(n, n, dtype=torch.bool)
    if causal:
        visible = torch.tril(visible)
    if window is not None:
        left, right = (window, None) if isinstance(window, int) else window
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        if left is not None:
            visible = visible & (j >= i - left)
        if right is not None:
            visible = visible & (j <= i + right)
    visible = visible[None, None]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # a column of sink logits, dropped after the softmax
        column = sinks.to(s.dtype)[None, :, None, None].expand(s.shape[0], s.shape[1], s.shape[2], 1)
        p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
        return torch.einsum("bhqk,bkhd->bqhd", p, v)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), v)


def relative_error(got, want):
    """Largest difference over the largest magnitude of `want`."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()
