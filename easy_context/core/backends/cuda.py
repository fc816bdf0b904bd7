"""cuda_flash and cuda_efficient: torch's fused CUDA flash and memory-efficient ops (private aten
ops, their calls pinned by tests on meta tensors)."""

from __future__ import annotations

import torch

from easy_context.core.backends.band import band_backward, band_forward, window_as_mask
from easy_context.core.backends.masks import INF, additive_bias, backward_lse, clear_empty_rows
from easy_context.core.backends.segments import cu_seqlens, segments_backward, segments_forward

__all__ = ["cuda_flash_forward", "cuda_flash_backward", "cuda_efficient_forward", "cuda_efficient_backward"]


# --------------------------------------------------------------------- cuda_flash
# The op takes K/V with fewer heads (GQA) and strided (B, H, S, D) views; it makes dout and out
# contiguous itself, in the (B, S, H, D) layout its kernel wants (a .contiguous() here would
# produce the (B, H, S, D) layout and a second copy).
def cuda_flash_forward(q, k, v, causal, scale, window=None, segments=None):
    if segments is not None:
        if q.shape[0] != 1:  # documents of several batch rows: not one flat token axis
            return segments_forward(cuda_flash_forward, q, k, v, causal, scale, segments, window=window)
        return _cuda_flash_varlen_forward(q, k, v, causal, scale, window, segments)
    if window is not None:
        return _cuda_flash_window_forward(q, k, v, scale, window)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


# A window needs the op under SDPA's, which takes window_size_left/right (bottom-right aligned, as
# masking.Block's windows are) and wants (B, S, H, D): HF's q/k/v are transposes of exactly that.
def _cuda_flash_window_forward(q, k, v, scale, window):
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        t(q), t(k), t(v), None, None, q.shape[2], k.shape[2], 0.0, False, False,
        scale=scale, window_size_left=window[0], window_size_right=window[1],
    )  # fmt: skip
    return t(out), lse


# Packed documents: the op's variable-length path, (total, H, D) tensors with int32 cu_seqlens
# (here one batch row, so total = S and (S, H, D) is a view of HF's (1, H, S, D)). Its lse is
# (H, total). Each document is a square, so the kernel's bottom-right causal and window
# alignment is the top-left one of masking.Block.
def _flat(x):
    return x[0].transpose(0, 1)


def _unflat(x):
    return x.transpose(0, 1)[None]


def _varlen_window(window) -> dict:
    return {} if window is None else {"window_size_left": window[0], "window_size_right": window[1]}


def _cuda_flash_varlen_forward(q, k, v, causal, scale, window, segments):
    cu = cu_seqlens(segments, q.device)
    longest = max(b - a for a, b in zip(segments, segments[1:]))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _flat(q), _flat(k), _flat(v), cu, cu, longest, longest, 0.0, causal, False,
        scale=scale, **_varlen_window(window),
    )  # fmt: skip
    return _unflat(out), lse[None]


def _cuda_flash_varlen_backward(dout, q, k, v, out, lse, causal, scale, window, segments):
    cu = cu_seqlens(segments, q.device)
    longest = max(b - a for a, b in zip(segments, segments[1:]))
    seed, offset = _flash_rng_placeholders(q.device)
    grads = torch.ops.aten._flash_attention_backward(
        _flat(dout), _flat(q), _flat(k), _flat(v), _flat(out), lse[0].contiguous(), cu, cu, longest, longest, 0.0,
        causal, seed, offset, scale=scale, **_varlen_window(window),
    )  # fmt: skip
    return tuple(_unflat(g) for g in grads)


def _flash_rng_placeholders(device: torch.device):
    """What the forward returns as (rng_state, unused) with dropout 0: uint64 (2,) and () (int64
    () on ROCm). The backward reads them only when dropout_p > 0; passing the forward's shapes
    makes the call the one SDPA's own autograd makes."""
    if torch.version.hip:
        return (torch.empty((), dtype=torch.int64, device=device),) * 2
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def cuda_flash_backward(dout, q, k, v, out, lse, causal, scale, window=None, segments=None):
    if segments is not None:
        if q.shape[0] != 1:
            return segments_backward(
                cuda_flash_backward, dout, q, k, v, out, lse, causal, scale, segments, window=window
            )
        return _cuda_flash_varlen_backward(dout, q, k, v, out, lse, causal, scale, window, segments)
    seed, offset = _flash_rng_placeholders(q.device)
    if window is not None:
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            t(dout), t(q), t(k), t(v), t(out), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, False,
            seed, offset, scale=scale, window_size_left=window[0], window_size_right=window[1],
        )  # fmt: skip
        return t(dq), t(dk), t(dv)
    # cum_seq_q/k None (undefined), as the forward returns them: a defined tensor sends the kernel
    # down its variable-length path, which wants int32 cu_seqlens of B + 1 entries.
    # lse is made contiguous because the kernel indexes it as a dense (B, H, Sq) array.
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse.contiguous(),
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )


# ----------------------------------------------------------------- cuda_efficient
# Its kernel pads the lse to a multiple of 32 queries (with +inf) and its backward reads the lse
# of a block of queries rounded up to 32 without bounds checks (mem_eff_attention's
# accumApplyLSEToSmem); ROCm's kernels neither pad nor accept padding (they view it as Sq).
_EFFICIENT_LSE_ALIGN = 1 if torch.version.hip else 32
# attn_bias rows must start aligned (bias.stride(2) % alignment == 0, alignment <= 16 elements).
_EFFICIENT_BIAS_ALIGN = 16


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _efficient_bias(mask, q):
    """The mask as the op's attn_bias: (B, Hq, Sq, Sk) in q's dtype, broadcast dims stride 0."""
    return None if mask is None else _per_head(additive_bias(mask, q.dtype, _EFFICIENT_BIAS_ALIGN), q)


def _per_head(bias, q):
    """A (B or 1, 1, Sq, Sk) bias as the (B, Hq, Sq, Sk) the op wants, without a copy."""
    return bias.expand(q.shape[0], q.shape[1], -1, -1)


def _efficient_backward_lse(lse: torch.Tensor, masked: bool) -> torch.Tensor:
    """The lse in the padded (B, H, Sq rounded up to 32) layout the forward hands to the backward,
    padding +inf like the kernel's own."""
    b, h, sq = lse.shape
    padded = lse.new_full((b, h, -(-sq // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN), INF, dtype=torch.float32)
    padded[..., :sq] = backward_lse(lse) if masked else lse
    return padded


def _with_dense_rows(out: torch.Tensor) -> torch.Tensor:
    """`out` as a view of a (B, S, H, D)-dense tensor (row slices of one qualify). The backward
    kernel reads out with a query stride of H * D whatever the tensor's strides say (o_strideM
    in mem_eff_attention's kernel_backward.h) and torch does not check it."""
    _, h, _, d = out.shape
    if out.stride(3) == 1 and out.stride(2) == h * d:
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def cuda_efficient_forward(q, k, v, causal, scale, mask=None, window=None):
    mask = window_as_mask(q, k, mask, window)
    if mask is None and window is not None:  # only the band, not Sq x Sk scores (band.py)
        return band_forward(_efficient_band_forward, q, k, v, scale, window, _EFFICIENT_BIAS_ALIGN)
    out, lse = _efficient_forward(q, k, v, causal, scale, _efficient_bias(mask, q))
    if mask is not None:  # unverified what the kernel gives rows with no allowed key: overwrite it
        out, lse = clear_empty_rows(out, lse, mask)
    return out, lse


def _efficient_forward(q, k, v, causal, scale, bias):
    # The op wants equal head counts: repeat K/V for GQA here only.
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1 and q.shape[2] == 1 and not causal:
        return _efficient_forward_one_row(q, k, v, scale, bias, n_rep)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _efficient_forward_one_row(q, k, v, scale, bias, n_rep):
    """One query row per head (a decoding step): the n_rep query heads that read one K/V head
    become n_rep rows of that head, so the K/V, a whole cache shard, is read as it is instead of
    repeated per query head (heads g * n_rep .. g * n_rep + n_rep - 1 read K/V head g, as
    _repeat_kv's repeat_interleave pairs them). The bias's one row serves all of them (stride 0)."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    rows = q.reshape(b, hkv, n_rep, d)
    if bias is not None:
        bias = bias[:, :1, :1].expand(b, hkv, n_rep, bias.shape[-1])
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        rows, k, v, bias, True, 0.0, False, scale=scale
    )
    return out.reshape(b, hq, 1, v.shape[-1]), lse[..., :n_rep].reshape(b, hq, 1)


def _efficient_band_forward(q, k, v, scale, bias):
    return _efficient_forward(q, k, v, False, scale, _per_head(bias, q))


def cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
    mask = window_as_mask(q, k, mask, window)
    if mask is None and window is not None:
        return band_backward(_efficient_band_backward, dout, q, k, v, out, lse, scale, window, _EFFICIENT_BIAS_ALIGN)
    return _efficient_backward(dout, q, k, v, out, lse, causal, scale, _efficient_bias(mask, q))


def _efficient_band_backward(dout, q, k, v, out, lse, scale, bias):
    return _efficient_backward(dout, q, k, v, out, lse, False, scale, _per_head(bias, q))


def _efficient_backward(dout, q, k, v, out, lse, causal, scale, bias):
    n_rep = q.shape[1] // k.shape[1]
    seed = offset = torch.empty((), dtype=torch.int64, device=q.device)  # read only with dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        _repeat_kv(k, n_rep),
        _repeat_kv(v, n_rep),
        bias,
        _with_dense_rows(out),
        _efficient_backward_lse(lse, bias is not None),
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    if n_rep > 1:  # each KV head's gradient is the sum over the query heads that read it
        dk = dk.unflatten(1, (k.shape[1], n_rep)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], n_rep)).sum(2)
    return dq, dk, dv
