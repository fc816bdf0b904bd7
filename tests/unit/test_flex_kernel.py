"""The flex backend (torch's FlexAttention) on its CPU path, forced: out, lse and gradients
against the math backend and a float64 reference, for the calls it exists for (a softcap with a
mask, documents inside a window), and its backward given the global out/lse of merged blocks.

The CUDA path runs the same code compiled; what differs there (Triton kernels, the public
function with grads) is not exercised here."""

import math

import pytest
import torch
from dynamo_limits import recompile_limit_hits
from kernel_cases import assert_close, inputs, make_mask, reference

from easy_context.core import kernels
from easy_context.core.backends import flex
from easy_context.core.blocks import merge_block

pytestmark = pytest.mark.skipif(not flex.flex_usable(), reason="this torch has no FlexAttention")

FLEX = kernels.BACKENDS["flex"]
MATH = kernels.BACKENDS["math"]
# fp32: the bound of the other backends' tests (measured: 6e-7); fp64: measured at most 1.3e-15.
TOL = {torch.float32: 2e-5, torch.float64: 1e-13}


def window_plane(sq, sk, left, right):
    """flash_attn's window as a (Sq, Sk) bool plane, from triangles: bottom-right aligned,
    key j within [i + sk - sq - left, i + sk - sq + right], -1 unlimited."""
    ones = torch.ones(sq, sk, dtype=torch.bool)
    plane = ones.tril(sk - sq + right) if right >= 0 else ones
    return plane & ones.triu(sk - sq - left) if left >= 0 else plane


def double_leaves(*xs):
    return [x.detach().double().clone().requires_grad_() for x in xs]


# name -> (hq, hkv, sq, sk, causal, mask kind, softcap, window)
CASES = {
    "causal": (4, 4, 48, 48, True, None, None, None),
    "causal-gqa-softcap": (4, 2, 48, 48, True, None, 2.0, None),
    "random-mask-empty-rows": (4, 2, 40, 56, False, "random", None, None),
    "softcap-with-mask": (4, 2, 48, 48, False, "block_diagonal", 2.0, None),
    "softcap-key-padding-gqa-1": (4, 1, 40, 24, False, "key_padding", 2.0, None),
    "documents-in-window": (4, 2, 48, 48, False, "block_diagonal", None, (6, 0)),
    "documents-in-window-softcap": (4, 2, 48, 48, False, "block_diagonal", 2.0, (9, 0)),
    "window-rectangular": (4, 2, 32, 48, False, None, None, (5, 3)),
    "shared-plane-softcap": (4, 2, 32, 48, False, "causal", 2.0, None),  # one (Sq, Sk) plane for the batch
    "window-wider-than-block": (4, 4, 24, 40, False, "random", None, (-1, 2)),
}


def call_args(name, dtype, seed=1):
    hq, hkv, sq, sk, causal, kind, softcap, window = CASES[name]
    q, k, v, dout = inputs(hq, hkv, sq, sk, dtype, layout="bshd", seed=seed)
    if softcap:
        q, k = q * 3, k * 3  # logits of order 10: a cap of 2 bends them
    mask = None if kind is None else make_mask(kind, sq, sk)
    if mask is not None:  # the (B or 1, 1, Sq, Sk) view kernels.py hands a backend
        mask = mask[(None,) * (4 - mask.dim())].expand(-1, 1, sq, sk)
    return q, k, v, dout, causal, mask, softcap, window


def as_mask(mask, window, sq, sk):
    """The mask math and the reference get: the window folded in."""
    if window is None:
        return mask
    plane = window_plane(sq, sk, *window)
    return plane if mask is None else mask & plane


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", CASES)
def test_flex_matches_math_and_the_float64_reference(name, dtype):
    q, k, v, dout, causal, mask, softcap, window = call_args(name, dtype)
    scale, tol = 0.25, TOL[dtype]
    flex_extra = {"mask": mask, "softcap": softcap, "window": window}
    out, lse = FLEX.forward(q, k, v, causal, scale, **{n: x for n, x in flex_extra.items() if x is not None})
    grads = FLEX.backward(
        dout, q, k, v, out, lse, causal, scale, **{n: x for n, x in flex_extra.items() if x is not None}
    )
    assert out.dtype == dtype and lse.dtype == dtype and lse.shape == q.shape[:3]
    assert grads[1].shape == k.shape and grads[2].shape == v.shape  # GQA: grads keep the KV-head shape

    full_mask = as_mask(mask, window, q.shape[2], k.shape[2])
    math_out, math_lse = kernels.attention_forward(q, k, v, causal, scale, MATH, mask=full_mask, softcap=softcap)
    math_grads = kernels.attention_backward(
        dout, q, k, v, math_out, math_lse, causal, scale, MATH, mask=full_mask, softcap=softcap
    )
    qr, kr, vr = double_leaves(q, k, v)
    ref_out, ref_lse = reference(qr, kr, vr, causal, scale, full_mask, softcap=softcap)
    ref_out.backward(dout.double())
    if softcap:
        assert (ref_out - reference(q, k, v, causal, scale, full_mask)[0]).abs().max() > 0.1  # the cap matters
    if window is not None:
        assert (ref_out - reference(q, k, v, causal, scale, mask)[0]).abs().max() > 0.1  # the window matters

    for got, want, math_got in ((out, ref_out, math_out), (lse, ref_lse, math_lse)):
        assert_close(got, want, tol)
        assert_close(got, math_got, 2 * tol)
    for got, want, math_got in zip(grads, (qr.grad, kr.grad, vr.grad), math_grads):
        bound = tol * max(1.0, want.abs().max().item())
        assert_close(got, want, bound)
        assert_close(got, math_got, 2 * bound)


def test_lse_is_natural_log_and_empty_rows_are_zero():
    """flex's kernels work in base 2; the lse this backend returns is the natural one, and a
    row with no allowed key has out 0, lse -inf and zero gradients in every input."""
    q, k, v, dout = inputs(4, 2, 24, 40, torch.float64, layout="bshd")
    mask = make_mask("random", 24, 40)
    out, lse = FLEX.forward(q, k, v, False, 0.3, mask)
    rows = (~mask.any(-1)).expand(2, 4, 24)
    assert rows.any() and (out[rows] == 0).all() and (lse[rows] == -math.inf).all()
    logits = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~mask, -math.inf)
    assert (lse[~rows] - logits.logsumexp(-1)[~rows]).abs().max() <= 1e-13
    dq, dk, dv = FLEX.backward(dout, q, k, v, out, lse, False, 0.3, mask)
    assert (dq[rows] == 0).all() and all(torch.isfinite(g).all() for g in (dq, dk, dv))
    # The empty rows' dout touches nothing: the same call with it zeroed gives the same dK/dV.
    _, dk0, dv0 = FLEX.backward(dout.masked_fill(rows[..., None], 0), q, k, v, out, lse, False, 0.3, mask)
    assert torch.equal(dk, dk0) and torch.equal(dv, dv0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "name,split", [("random-mask-empty-rows", 20), ("softcap-with-mask", 19), ("documents-in-window-softcap", 30)]
)
def test_backward_with_the_global_out_and_lse_of_merged_blocks(name, split, dtype):
    """Keys split in two blocks, each run by flex, merged with merge_block; each block's backward
    given the merged out/lse: dq summed, dk/dv concatenated equal autograd through attention on
    the whole key range. Rows of the random mask are empty in one block and not the other, or
    in both."""
    q, k, v, dout, causal, mask, softcap, window = call_args(name, dtype, seed=3)
    assert not causal
    scale, tol = 0.25, TOL[dtype]
    sq, sk = q.shape[2], k.shape[2]
    full_mask = as_mask(mask, window, sq, sk)
    halves = (slice(0, split), slice(split, sk))
    if name == "random-mask-empty-rows":  # rows with keys in one block only (rows 3 and 5: none)
        full_mask = full_mask.clone()
        full_mask[0, :, 7, halves[0]] = False
        full_mask[:, :, 9, halves[1]] = False
    out = torch.zeros(q.shape, dtype=kernels.accumulation_dtype(dtype))
    lse = torch.full(q.shape[:3], -math.inf, dtype=out.dtype)
    for keys in halves:
        block_mask = full_mask[..., keys]  # the window is in the mask: offsets differ per block
        merge_block(out, lse, *FLEX.forward(q, k[:, :, keys], v[:, :, keys], False, scale, block_mask, softcap=softcap))
    out = out.to(dtype)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for keys in halves:
        grads = FLEX.backward(
            dout, q, k[:, :, keys], v[:, :, keys], out, lse, False, scale, full_mask[..., keys], softcap=softcap
        )
        dq += grads[0]
        dks.append(grads[1])
        dvs.append(grads[2])

    qr, kr, vr = double_leaves(q, k, v)
    ref_out, ref_lse = reference(qr, kr, vr, False, scale, full_mask, softcap=softcap)
    ref_out.backward(dout.double())
    assert_close(out, ref_out, tol)
    assert_close(lse, ref_lse, tol)
    for got, want in ((dq, qr.grad), (torch.cat(dks, 2), kr.grad), (torch.cat(dvs, 2), vr.grad)):
        assert_close(got, want, tol * max(1.0, want.abs().max().item()))


def test_window_rule_is_flash_attns():
    """The mask_mod flex calls get for a window (the backend's own, not a restatement of it)."""
    i, j = torch.arange(24)[:, None], torch.arange(40)[None, :]

    def rule(sq, sk, window):
        mask_mod = flex.flex_window_rule(sq, sk, window)
        return None if mask_mod is None else (lambda q_idx, kv_idx: mask_mod(0, 0, q_idx, kv_idx))

    assert rule(24, 24, (-1, -1)) is None
    square = torch.arange(24)[None, :]
    assert torch.equal(rule(24, 24, (-1, 0))(i, square), torch.ones(24, 24, dtype=torch.bool).tril())  # causal
    assert torch.equal(rule(24, 40, (-1, 0))(i, j), torch.ones(24, 40, dtype=torch.bool).tril(16))  # bottom-right
    assert torch.equal(rule(24, 40, (3, 2))(i, j), (j >= i + 13) & (j <= i + 18))
    assert torch.equal(rule(24, 40, (4, -1))(i, j), j >= i + 12)
    for window in ((3, 2), (4, -1), (-1, 0), (0, 0)):
        assert torch.equal(rule(24, 40, window)(i, j), window_plane(24, 40, *window))


def test_flex_is_forced_only_on_cpu(monkeypatch):
    q = torch.zeros(1, 2, 4, 16)
    assert "flex" not in kernels.available_backends("cpu", torch.float32)
    assert kernels.select_backend(q, masked=True, softcap=True).name == "math"
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "flex")
    for masked in (False, True):
        for softcap in (False, True):
            assert kernels.select_backend(q, masked=masked, softcap=softcap).name == "flex"
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "cuda_flash")
    with pytest.raises(ValueError, match=r"usable here: \['cpu_flash', 'math', 'flex'\]"):
        kernels.select_backend(q)


def test_flex_through_attention_forward_counts_and_checks_like_the_others(monkeypatch):
    q, k, v, dout = inputs(4, 2, 32, 32, torch.float32)
    mask = make_mask("block_diagonal", 32, 32)
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "flex")
    kernels.FORWARD_CALLS.start()
    out, lse = kernels.attention_forward(q, k, v, False, 0.25, mask=mask, softcap=2.0)
    assert kernels.FORWARD_CALLS.calls == 1
    kernels.FORWARD_CALLS.start()
    want = kernels.attention_forward(q, k, v, False, 0.25, MATH, mask=mask, softcap=2.0)
    assert_close(out, want[0], 2e-6)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, False, 0.25, mask=mask, softcap=2.0)
    want_grads = kernels.attention_backward(dout, q, k, v, *want, False, 0.25, MATH, mask=mask, softcap=2.0)
    for got, ref in zip(grads, want_grads):
        assert_close(got, ref, 2e-5 * max(1.0, ref.abs().max().item()))


def test_flex_compiles_once_per_call_structure(monkeypatch):
    """flex runs compiled as on CUDA (Dynamo's eager backend here): calls at several lengths and
    windows stay within the compiled callable's recompile limit, past which flex would run eager
    and materialise every score, and more lengths and windows compile nothing new."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv(flex.FLEX_COMPILE_ENV, "eager")
    # Dynamo's own limit far below what these calls compile: the compiled flex carries its own
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    torch._dynamo.reset()
    counters.clear()

    def calls(shapes, windows):
        for sq, sk in shapes:
            q, k, v, _ = inputs(4, 2, sq, sk, torch.float32)
            per_row = make_mask("block_diagonal", sq, sk)  # (2, 1, Sq, Sk): documents differ per row
            for window in windows:  # two structures: a window alone; documents per row, softcapped
                flex.flex_forward(q, k, v, False, 0.25, window=window)
                flex.flex_forward(q, k, v, False, 0.25, mask=per_row, softcap=2.0, window=window)

    try:
        with recompile_limit_hits() as limit_hits:
            # Dynamo compiles a structure's first call at its sizes, and makes the query and key
            # lengths symbolic once each has changed: then no length or window compiles again.
            calls(((16, 16), (16, 40), (24, 24)), ((3, 2), (-1, 0)))
            first = counters["stats"]["unique_graphs"]
            calls(((8, 56), (40, 40)), ((5, 0), (2, 7)))
        assert not limit_hits, limit_hits[0]
        assert 0 < first == counters["stats"]["unique_graphs"] <= flex.RECOMPILE_LIMIT // 2, (first, counters["stats"])
    finally:
        torch._dynamo.reset()
