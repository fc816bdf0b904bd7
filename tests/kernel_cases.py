"""What the kernel tests share (tests/unit/test_kernels.py, test_flex_kernel.py,
test_cuda_kernel_calls.py): the float64 reference attention, random inputs, the masks a caller
passes, the comparison with -inf rows, and the window rule written out."""

import math

import torch


def reference(q, k, v, causal, scale, mask=None, softcap=None, sinks=None):
    """float64 attention with autograd; returns out and lse. Rows with no allowed key: out 0,
    lse -inf, and (their lse being computed over zeros instead) no NaN in any gradient.
    softcap: logits c * tanh(s / c); sinks (Hq,): a logit per head joining every row's
    softmax with a zero value (the lse includes it)."""
    q, k, v = (x.double() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if sinks is not None:  # a last key column: the sink's logit, its value zero
        scores = torch.cat([scores, sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])], -2)
        mask = (
            None
            if mask is None
            else torch.cat([mask.expand(*mask.shape[:-1], k.shape[2]), mask.new_ones(*mask.shape[:-1], 1)], -1)
        )
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
        if sinks is not None:
            allowed[:, -1] = True
    if mask is not None:
        allowed = allowed & mask
    scores = scores.masked_fill(~allowed, -math.inf)
    empty = ~allowed.any(-1, keepdim=True)
    lse = scores.masked_fill(empty, 0).logsumexp(-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse.squeeze(-1).masked_fill(empty.squeeze(-1), -math.inf)


def inputs(hq, hkv, sq, sk, dtype, d=16, seed=0, layout="bhsd"):
    """q, k, v, dout as (B, H, S, D); layout "bshd": transposed views of (B, S, H, D)-dense
    tensors, the way HF hands them over."""
    g = torch.Generator().manual_seed(seed)
    if layout == "bhsd":
        make = lambda h, s: torch.randn(2, h, s, d, generator=g).to(dtype)  # noqa: E731
    else:
        make = lambda h, s: torch.randn(2, s, h, d, generator=g).to(dtype).transpose(1, 2)  # noqa: E731
    return make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq)


def make_mask(kind, sq, sk, seed=0):
    """Bool masks broadcastable to (B=2, 1, Sq, Sk), each with the shape a caller would pass."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":  # with rows that allow no key: row 3 everywhere, row 5 in batch 0 only
        mask = torch.rand(2, 1, sq, sk, generator=g) < 0.4
        mask[:, :, 3] = False
        mask[0, :, 5] = False
        return mask
    if kind == "causal":  # bottom-right aligned causal, as a (Sq, Sk) plane for every batch row
        return torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    if kind == "block_diagonal":  # packed documents, boundaries differ per batch row
        q_pos, k_pos = torch.arange(sq) * sk // sq, torch.arange(sk)
        planes = []
        for bounds in ([sk // 3, sk // 2], [sk // 4]):
            doc = lambda pos, bounds=bounds: torch.bucketize(pos, torch.tensor(bounds), right=True)  # noqa: E731
            planes.append(doc(q_pos)[:, None] == doc(k_pos)[None, :])
        return torch.stack(planes)[:, None]
    if kind == "key_padding":  # (B, 1, 1, Sk): batch 1 has its last keys padded, batch 0 all of them
        mask = torch.ones(2, 1, 1, sk, dtype=torch.bool)
        mask[0] = False
        mask[1, ..., sk - 7 :] = False
        return mask
    raise ValueError(kind)


def assert_close(got, want, tol):
    """Equal -inf pattern, then |got - want| <= tol elsewhere, and no NaN anywhere."""
    assert not torch.isnan(got).any()
    got, want = got.double(), want.double()
    assert torch.equal(got == -math.inf, want == -math.inf)
    finite = want != -math.inf
    assert (got[finite] - want[finite]).abs().max() <= tol


def window_truth(sq, sk, window):
    """The window rule written out: row r may attend column c iff r + sk - sq - left <= c <=
    r + sk - sq + right (-1: no limit)."""
    left, right = window
    r, c = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= c >= r + sk - sq - left
    if right >= 0:
        allowed &= c <= r + sk - sq + right
    return allowed
