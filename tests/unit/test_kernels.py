"""Every local kernel backend against a float64 reference: out, lse and gradients."""

import math

import pytest
import torch
from kernel_cases import assert_close, inputs, make_mask, reference, window_truth
from torch.utils._python_dispatch import TorchDispatchMode

from easy_context.core import kernels
from easy_context.core.backends import band, math_tiles
from easy_context.core.blocks import merge_block

CPU_BACKENDS = kernels.available_backends("cpu", torch.float32)
# The lse is fp32 whatever the inputs' dtype: bf16 inputs get their own lse bound, not the
# bf16 out's 3e-2 (measured: at most 6.3e-5 for bf16, 1e-6 for fp32).
LSE_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-3}


def test_cpu_flash_backend_is_available_here():
    # Pins the private aten op this package relies on; the CI torch must have it.
    assert CPU_BACKENDS == ["cpu_flash", "math"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    "hq,hkv,sq,sk,causal",
    [(4, 4, 64, 64, True), (4, 2, 64, 64, True), (4, 1, 48, 48, True), (4, 2, 32, 96, False), (4, 4, 96, 32, False)],
)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_backend_matches_reference(backend, dtype, tol, hq, hkv, sq, sk, causal, layout):
    q, k, v, dout = inputs(hq, hkv, sq, sk, dtype, layout=layout)
    scale = 0.3
    be = kernels.BACKENDS[backend]
    out, lse = kernels.attention_forward(q, k, v, causal, scale, be)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, hq, sq)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, causal, scale)
    ref_out.backward(dout.double())
    assert (out.double() - ref_out).abs().max() <= tol
    assert (lse.double() - ref_lse).abs().max() <= LSE_TOL[dtype]
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, causal, scale, be)
    assert dk.shape == k.shape and dv.shape == v.shape  # GQA: grads keep the KV-head shape
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert (got.double() - want).abs().max() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("hq,hkv,sq,sk", [(4, 4, 48, 48), (4, 2, 32, 80), (4, 1, 72, 40)])
@pytest.mark.parametrize("kind", ["random", "causal", "block_diagonal", "key_padding"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_masked_backend_matches_reference(backend, dtype, tol, hq, hkv, sq, sk, kind, layout):
    q, k, v, dout = inputs(hq, hkv, sq, sk, dtype, layout=layout, seed=1)
    mask, scale = make_mask(kind, sq, sk), 0.3
    be = kernels.BACKENDS[backend]
    assert be.supports_mask
    out, lse = kernels.attention_forward(q, k, v, False, scale, be, mask=mask)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, hq, sq)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, False, scale, mask)
    ref_out.backward(dout.double())
    assert_close(out, ref_out, tol)
    assert_close(lse, ref_lse, LSE_TOL[dtype])
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, False, scale, be, mask=mask)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert_close(got, want, tol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_with_no_allowed_key_give_zero_out_minus_inf_lse_and_zero_grads(backend, dtype):
    q, k, v, dout = inputs(4, 2, 24, 40, dtype, layout="bshd")
    mask = make_mask("random", 24, 40)
    empty = ~mask.any(-1)  # (2, 1, 24)
    assert empty[:, 0, 3].all() and empty[0, 0, 5] and not empty[1, 0, 5]
    be = kernels.BACKENDS[backend]
    out, lse = kernels.attention_forward(q, k, v, False, 0.25, be, mask=mask)
    rows = empty.expand(2, 4, 24)
    assert (out[rows] == 0).all() and (lse[rows] == -math.inf).all()
    assert torch.isfinite(lse[~rows]).all() and not torch.isnan(out).any()
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, False, 0.25, be, mask=mask)
    assert (dq[rows] == 0).all()
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad).all()
    # Those rows add nothing to dK/dV: the gradients equal those of the same call without them.
    keep = ~empty[:, 0, :]  # batch 1 only lacks row 3; compare batch 1 over its kept rows
    rows1 = keep[1].nonzero().squeeze(1)
    sub = lambda x: x[1:, :, rows1]  # noqa: E731
    sub_out, sub_lse = kernels.attention_forward(sub(q), k[1:], v[1:], False, 0.25, be, mask=mask[1:, :, rows1])
    _, sub_dk, sub_dv = kernels.attention_backward(
        sub(dout), sub(q), k[1:], v[1:], sub_out, sub_lse, False, 0.25, be, mask=mask[1:, :, rows1]
    )
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # measured: equal; bf16's bound is about one ulp
    assert (dk[1:].float() - sub_dk.float()).abs().max() <= tol
    assert (dv[1:].float() - sub_dv.float()).abs().max() <= tol


def test_mask_shapes_broadcast_and_bad_masks_are_clear_errors():
    q, k, v, _ = inputs(4, 2, 16, 24, torch.float32)
    be = kernels.BACKENDS["math"]
    plane = make_mask("causal", 16, 24)
    full = kernels.attention_forward(q, k, v, False, 0.3, be, mask=plane.expand(2, 1, 16, 24))
    for shaped in (plane, plane[None], plane[None, None]):
        got = kernels.attention_forward(q, k, v, False, 0.3, be, mask=shaped)
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])
    with pytest.raises(ValueError, match="causal"):
        kernels.attention_forward(q[:, :, :16], k[:, :, :16], v[:, :, :16], True, 0.3, be, mask=plane[:, :16])
    with pytest.raises(TypeError, match="bool"):
        kernels.attention_forward(q, k, v, False, 0.3, be, mask=plane.float())
    with pytest.raises(ValueError, match="broadcast"):
        kernels.attention_forward(q, k, v, False, 0.3, be, mask=plane.expand(2, 4, 16, 24))  # per-head
    with pytest.raises(ValueError, match="cannot take a mask"):
        kernels.attention_forward(q, k, v, False, 0.3, kernels.BACKENDS["cuda_flash"], mask=plane)


def test_masked_calls_pick_a_backend_that_takes_a_mask(monkeypatch):
    q = torch.zeros(1, 2, 4, 8)
    assert kernels.select_backend(q, masked=True).name == "cpu_flash"
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "math")
    assert kernels.select_backend(q, masked=True).name == "math"
    # A forced backend that cannot take a mask serves unmasked calls; masked ones fall back.
    monkeypatch.setattr(kernels, "_usable_backends", lambda *key: ("cuda_flash", "cuda_efficient", "math"))
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "cuda_flash")
    assert kernels.select_backend(q).name == "cuda_flash"
    assert kernels.select_backend(q, masked=True).name == "cuda_efficient"


def test_masked_forward_counts_allowed_pairs_per_batch_row():
    q, k, v, _ = inputs(4, 2, 24, 40, torch.float32)
    mask = make_mask("random", 24, 40)
    counter = kernels.FORWARD_CALLS
    counter.start()
    kernels.attention_forward(q, k, v, False, 0.3, mask=mask)
    kernels.attention_forward(q, k, v, False, 0.3, mask=mask[:1])  # one plane for both rows
    kernels.attention_forward(q, k, v, False, 0.3)
    first, second = mask[0].sum().item(), mask[1].sum().item()
    assert counter.calls == 3
    assert counter.products == (first + second + 1) // 2 + first + 24 * 40
    counter.enabled = False
    kernels.attention_forward(q, k, v, False, 0.3, mask=mask)
    assert counter.calls == 3
    counter.reset()


def test_counters_are_off_unless_started():
    q, k, v, _ = inputs(4, 2, 24, 40, torch.float32)
    counter = kernels.FORWARD_CALLS
    assert not counter.enabled  # nobody started it: no counting work on any rank by default
    kernels.attention_forward(q, k, v, False, 0.3, mask=make_mask("random", 24, 40))
    assert counter.calls == 0


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_cpu_flash_takes_transposed_views_without_copies():
    q, k, v, dout = inputs(4, 2, 32, 48, torch.bfloat16, layout="bshd")
    be = kernels.BACKENDS["cpu_flash"]
    out, lse = be.forward(q, k, v, False, 0.3)
    lse_rows = torch.empty(2, 4, 64)[:, :, :32].copy_(lse)  # a row slice of a ring's lse
    with _OpRecorder() as recorded:
        be.backward(dout, q, k, v, out, lse_rows, False, 0.3)
    copies = [op for op in recorded.ops if op.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_)]
    assert recorded.ops and not copies


def test_merge_of_two_halves_equals_full_attention():
    q, k, v, _ = inputs(4, 2, 32, 64, torch.float64)
    be = kernels.BACKENDS["math"]
    full_out, full_lse = kernels.attention_forward(q, k, v, False, 0.25, be)
    out, lse = kernels.attention_forward(q, k[:, :, :40], v[:, :, :40], False, 0.25, be)
    out, lse = out.clone(), lse.clone()
    merge_block(out, lse, *kernels.attention_forward(q, k[:, :, 40:], v[:, :, 40:], False, 0.25, be))
    # float64: measured 8e-16 for both
    assert torch.allclose(out, full_out, rtol=0, atol=1e-14) and torch.allclose(lse, full_lse, rtol=0, atol=1e-14)


def test_forced_backend_that_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "flash_attn")
    with pytest.raises(ValueError, match="usable here"):
        kernels.select_backend(torch.zeros(1, 1, 1, 8))


def test_causal_blocks_must_be_square():
    q, k, v, _ = inputs(4, 2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="square"):
        kernels.attention_forward(q, k, v, True, 0.25)


# ------------------------------------------------------- softcapping, tiles and sinks
@pytest.mark.parametrize("causal,kind", [(True, None), (False, None), (False, "block_diagonal")])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_softcapped_attention_matches_reference(causal, kind, hq, hkv):
    q, k, v, dout = inputs(hq, hkv, 48, 48, torch.float32, layout="bshd")
    q, k = q * 3, k * 3  # logits of order 10: a cap of 2 bends them
    mask = None if kind is None else make_mask(kind, 48, 48)
    backend = kernels.select_backend(q, masked=mask is not None, softcap=True)
    assert backend.name == "math"  # the CPU backend that softcaps
    out, lse = kernels.attention_forward(q, k, v, causal, 0.25, backend, mask=mask, softcap=2.0)
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, causal, 0.25, backend, mask=mask, softcap=2.0)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    want = reference(qr, kr, vr, causal, 0.25, mask, softcap=2.0)[0]
    want.backward(dout.double())
    assert (want - reference(q, k, v, causal, 0.25, mask)[0]).abs().max() > 0.1  # the cap matters here
    for got, ref in ((out, want), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert (got.double() - ref).abs().max() <= 2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("causal,kind,softcap", [(True, None, None), (False, "random", None), (True, None, 2.0)])
def test_math_backend_in_row_tiles_equals_one_tile(monkeypatch, causal, kind, softcap):
    q, k, v, dout = inputs(4, 2, 40, 40, torch.float32)
    mask = None if kind is None else make_mask(kind, 40, 40)
    math_backend = kernels.BACKENDS["math"]
    one = kernels.attention_forward(q, k, v, causal, 0.25, math_backend, mask=mask, softcap=softcap)
    one_grads = kernels.attention_backward(dout, q, k, v, *one, causal, 0.25, math_backend, mask=mask, softcap=softcap)
    monkeypatch.setattr(math_tiles, "MATH_TILE_LOGITS", 2 * 4 * 40 * 7)  # tiles of 7 query rows
    assert len(math_tiles.row_tiles(q, k)) == 6
    tiled = kernels.attention_forward(q, k, v, causal, 0.25, math_backend, mask=mask, softcap=softcap)
    tiled_grads = kernels.attention_backward(
        dout, q, k, v, *tiled, causal, 0.25, math_backend, mask=mask, softcap=softcap
    )
    for got, want in zip((*tiled, *tiled_grads), (*one, *one_grads)):  # fp32 sums in another order
        assert_close(got, want, 1e-6 * max(1.0, want[want != -math.inf].abs().max().item()))


class _ConversionCounter(TorchDispatchMode):
    """Counts dtype conversions (aten._to_copy) of tensors sharing storage with `watched`."""

    def __init__(self, *watched):
        super().__init__()
        self.storages = {x.untyped_storage().data_ptr() for x in watched}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        source = args[0] if args else None
        if func.overloadpacket == torch.ops.aten._to_copy and isinstance(source, torch.Tensor):
            self.count += source.untyped_storage().data_ptr() in self.storages
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal,kind,softcap", [(True, None, None), (False, "random", 2.0)])
def test_math_backend_converts_k_and_v_once_per_call(monkeypatch, causal, kind, softcap):
    """bf16 K/V become fp32 once per forward and once per backward, however many tiles there
    are (before: once per tile, the whole K/V range again in every tile)."""
    q, k, v, dout = inputs(4, 2, 40, 40, torch.bfloat16)
    mask = None if kind is None else make_mask(kind, 40, 40)
    math_backend = kernels.BACKENDS["math"]
    monkeypatch.setattr(math_tiles, "MATH_TILE_LOGITS", 2 * 4 * 40 * 7)  # tiles of 7 query rows
    assert len(math_tiles.row_tiles(q, k)) == 6
    with _ConversionCounter(k) as k_count, _ConversionCounter(v) as v_count:
        out, lse = kernels.attention_forward(q, k, v, causal, 0.25, math_backend, mask=mask, softcap=softcap)
    assert (k_count.count, v_count.count) == (1, 1)
    with _ConversionCounter(k) as k_count, _ConversionCounter(v) as v_count:
        kernels.attention_backward(dout, q, k, v, out, lse, causal, 0.25, math_backend, mask=mask, softcap=softcap)
    assert (k_count.count, v_count.count) == (1, 1)


@pytest.mark.parametrize("causal,kind,softcap", [(True, None, None), (False, "random", 2.0)])
def test_math_backend_avoids_ops_whose_cpu_precision_varies(causal, kind, softcap):
    """The reference backend computes exp and tanh from exp2 and sigmoid: torch's CPU exp, tanh
    and logsumexp (MKL vector math) were measured off by up to 1.5e-4 relative on some first
    calls after a matmul (math_tiles.py says more); exp2 and sigmoid never varied."""
    q, k, v, dout = inputs(4, 2, 40, 40, torch.float32)
    mask = None if kind is None else make_mask(kind, 40, 40)
    math_backend = kernels.BACKENDS["math"]
    with _OpRecorder() as recorder:
        out, lse = kernels.attention_forward(q, k, v, causal, 0.25, math_backend, mask=mask, softcap=softcap)
        kernels.attention_backward(dout, q, k, v, out, lse, causal, 0.25, math_backend, mask=mask, softcap=softcap)
    aten, ops = torch.ops.aten, {op.overloadpacket for op in recorder.ops}
    assert ops & {aten.exp2, aten.exp2_}
    assert not ops & {aten.exp, aten.exp_, aten.tanh, aten.tanh_, aten.logsumexp}


def test_math_backend_sizes_its_tiles_once_per_call(monkeypatch):
    """The tile size (on CUDA a driver call) is read once per forward and once per backward."""
    q, k, v, dout = inputs(4, 2, 40, 40, torch.float32)
    sizes = []

    def counted(device, dtype):
        sizes.append((device.type, dtype))
        return 2 * 4 * 40 * 7  # tiles of 7 query rows

    monkeypatch.setattr(math_tiles, "tile_logits", counted)
    math_backend = kernels.BACKENDS["math"]
    out, lse = kernels.attention_forward(q, k, v, True, 0.25, math_backend)
    kernels.attention_backward(dout, q, k, v, out, lse, True, 0.25, math_backend)
    assert sizes == [("cpu", torch.float32)] * 2


def test_cuda_math_tiles_follow_free_device_memory(monkeypatch):
    """On CUDA a tile takes MATH_CUDA_FREE_FRACTION of the free memory over
    MATH_TILE_TEMPORARIES temporaries of the accumulation dtype, never fewer logits than the
    CPU tile nor more than MATH_CUDA_MAX_TILE_LOGITS; CPU keeps its cache-sized tile.
    mem_get_info is faked: no GPU needed."""
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return free, 141 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    cuda = torch.device("cuda", 0)
    per_logit = 4 * math_tiles.MATH_TILE_TEMPORARIES  # fp32 accumulation for bf16 and fp32
    for free in (4 * 2**30, 12 * 2**30):
        want = int(free * math_tiles.MATH_CUDA_FREE_FRACTION) // per_logit
        assert math_tiles.MATH_TILE_LOGITS < want < math_tiles.MATH_CUDA_MAX_TILE_LOGITS
        assert math_tiles.tile_logits(cuda, torch.bfloat16) == want
        assert math_tiles.tile_logits(cuda, torch.float32) == want
        assert math_tiles.tile_logits(cuda, torch.float64) == want // 2  # fp64 logits are twice the size
    assert asked == [cuda] * 6
    free = 2**20  # almost nothing free: the lower bound
    assert math_tiles.tile_logits(cuda, torch.bfloat16) == math_tiles.MATH_TILE_LOGITS
    free = 2**45  # more than any tile needs: the upper bound
    assert math_tiles.tile_logits(cuda, torch.bfloat16) == math_tiles.MATH_CUDA_MAX_TILE_LOGITS
    asked.clear()
    assert math_tiles.tile_logits(torch.device("cpu"), torch.bfloat16) == math_tiles.MATH_TILE_LOGITS
    assert asked == []  # CPU never asks the driver
    # The case: a 16K block, 16 heads, 100 GiB free: 4096-row tiles instead of 8.
    free = 100 * 2**30
    q = torch.empty(1, 16, 16384, 128, device="meta")
    rows = math_tiles.row_tiles(q, q, math_tiles.tile_logits(cuda, torch.bfloat16))[0]
    assert rows.stop == math_tiles.MATH_CUDA_MAX_TILE_LOGITS // (16 * 16384) == 4096


def test_softcap_is_never_sent_to_a_backend_without_it(monkeypatch):
    q, k, v, _ = inputs(4, 2, 16, 16, torch.float32)
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "cpu_flash")
    assert kernels.select_backend(q).name == "cpu_flash"
    assert kernels.select_backend(q, softcap=True).name == "math"
    with pytest.raises(ValueError, match="cannot softcap"):
        kernels.attention_forward(q, k, v, True, 0.25, kernels.BACKENDS["cpu_flash"], softcap=2.0)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_sinks_folded_after_the_merge_equal_a_softmax_with_the_sink(softcap):
    """ring.fold_sinks / sinks_grad on one rank: out, dq, dk, dv and d sinks against autograd
    through a softmax with the sink column (gpt-oss's eager attention)."""
    from easy_context.core.ring import ring_attention
    from easy_context.modes.zigzag_ring_attn import CAUSAL_STEPS

    q, k, v, dout = inputs(4, 2, 40, 40, torch.float32, layout="bshd")
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out = ring_attention(*leaves[:3], 0.25, CAUSAL_STEPS, None, softcap=softcap, sinks=leaves[3])
    out.backward(dout)
    refs = [x.double().requires_grad_() for x in (q, k, v, sinks)]
    want = reference(*refs[:3], True, 0.25, softcap=softcap, sinks=refs[3])[0]
    want.backward(dout.double())
    assert (want - reference(q, k, v, True, 0.25, softcap=softcap)[0]).abs().max() > 0.05  # the sinks matter
    assert (out.double() - want).abs().max() <= 2e-5
    for leaf, ref in zip(leaves, refs):
        assert (leaf.grad.double() - ref.grad).abs().max() <= 2e-5 * max(1.0, ref.grad.abs().max().item())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("sq,sk", [(32, 32), (24, 56), (40, 24)])
@pytest.mark.parametrize("window", [(7, 0), (31, -1), (5, 3), (-1, 4), (0, 0)])
def test_window_blocks_match_the_reference(backend, dtype, tol, sq, sk, window):
    """Windows run natively (cpu_flash: a cached band bias) or as a mask (math); more queries
    than keys leaves rows empty, which the mask path handles."""
    q, k, v, dout = inputs(4, 2, sq, sk, dtype, layout="bshd", seed=2)
    be, scale = kernels.BACKENDS[backend], 0.3
    out, lse = kernels.attention_forward(q, k, v, False, scale, be, window=window)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, False, scale, window_truth(sq, sk, window))
    ref_out.backward(dout.double())
    assert_close(out, ref_out, tol)
    assert_close(lse, ref_lse, LSE_TOL[dtype])
    grads = kernels.attention_backward(dout, q, k, v, out, lse, False, scale, be, window=window)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert_close(got, want, tol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("window", [(100, 0), (40, -1), (3, 5), (-1, 2), (70, 0)])
def test_cpu_band_tiles_match_the_reference(monkeypatch, window):
    """cpu_flash runs a long band in row tiles, each against the keys its rows reach."""
    monkeypatch.setattr(band, "BAND_TILE_ROWS", 16)
    monkeypatch.setattr(band, "BAND_WHOLE_PRODUCTS", 0)
    sq, sk = 72, 110
    assert len(band.band_tiles(sq, sk, window)) > 1
    q, k, v, dout = inputs(4, 2, sq, sk, torch.float32, layout="bshd", seed=4)
    be, scale = kernels.BACKENDS["cpu_flash"], 0.3
    out, lse = kernels.attention_forward(q, k, v, False, scale, be, window=window)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, False, scale, window_truth(sq, sk, window))
    ref_out.backward(dout.double())
    assert_close(out, ref_out, 2e-5)
    assert_close(lse, ref_lse, LSE_TOL[torch.float32])
    grads = kernels.attention_backward(dout, q, k, v, out, lse, False, scale, be, window=window)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert_close(got, want, 2e-5 * max(1.0, want.abs().max().item()))


def test_window_masks_are_built_once_per_shape():
    """No bias or mask per call: the band of a shape is built once and reused."""
    q, k, v, _ = inputs(4, 2, 32, 48, torch.float32, seed=3)
    kernels.attention_forward(q, k, v, False, 0.3, kernels.BACKENDS["cpu_flash"], window=(9, 0))
    recorder = _OpRecorder()
    with recorder:
        kernels.attention_forward(q, k, v, False, 0.3, kernels.BACKENDS["cpu_flash"], window=(9, 0))
    assert [str(op) for op in recorder.ops if "flash" not in str(op)] == [], recorder.ops


def test_windows_are_checked():
    q, k, v, _ = inputs(4, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="window must be"):
        kernels.attention_forward(q, k, v, False, 0.3, window=(-2, 0))
    with pytest.raises(ValueError, match="window must be"):
        kernels.attention_forward(q, k, v, True, 0.3, window=(3, 0))


def segments_truth(segments, causal, window):
    """Documents on the diagonal written out: row r may attend column c iff both lie in one
    document, and c <= r (causal) or the window allows it."""
    n = segments[-1]
    document = torch.repeat_interleave(torch.arange(len(segments) - 1), torch.tensor(segments).diff())
    allowed = document[:, None] == document[None, :]
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    if window is not None:
        allowed &= window_truth(n, n, window)
    return allowed


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (False, (5, 0)), (False, (3, 2))])
@pytest.mark.parametrize("segments", [(0, 1, 19, 40), (0, 40), (0, 7, 8, 9, 33, 40)])
def test_segments_match_the_reference(dtype, tol, causal, window, segments):
    """Packed documents in one call (cpu_flash: a call per document, concatenated)."""
    q, k, v, dout = inputs(4, 2, 40, 40, dtype, layout="bshd", seed=5)
    be, scale = kernels.BACKENDS["cpu_flash"], 0.3
    kernels.FORWARD_CALLS.start()
    out, lse = kernels.attention_forward(q, k, v, causal, scale, be, window=window, segments=segments)
    truth = segments_truth(segments, causal, window)
    assert kernels.FORWARD_CALLS.calls == 1 and kernels.FORWARD_CALLS.products == int(truth.sum())
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, False, scale, truth)
    ref_out.backward(dout.double())
    assert_close(out, ref_out, tol)
    assert_close(lse, ref_lse, LSE_TOL[dtype])
    grads = kernels.attention_backward(dout, q, k, v, out, lse, causal, scale, be, window=window, segments=segments)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert got.shape == want.shape
        assert_close(got, want, tol * max(1.0, want.abs().max().item()))


def test_segments_are_checked_and_only_go_where_they_are_taken(monkeypatch):
    q, k, v, _ = inputs(4, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="segments must run from 0"):
        kernels.attention_forward(q, k, v, True, 0.3, segments=(0, 4, 7))
    with pytest.raises(ValueError, match="segments must be increasing"):
        kernels.attention_forward(q, k, v, True, 0.3, segments=(0, 4, 4, 8))
    with pytest.raises(ValueError, match="cannot take segments"):
        kernels.attention_forward(q, k, v, True, 0.3, kernels.BACKENDS["math"], segments=(0, 4, 8))
    assert kernels.select_backend(q, segments=True).name == "cpu_flash"
    assert kernels.select_backend(q, softcap=True, segments=True) is None  # the caller splits the block
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "math")
    assert kernels.select_backend(q, segments=True) is None


def test_large_document_blocks_are_copied_into_one_result(monkeypatch):
    """Past CONCAT_ELEMENTS the documents' results are copied into one preallocated result (at
    most one document's result alive besides it), with the same values as concatenated."""
    from easy_context.core.backends import segments as segments_module

    q, k, v, dout = inputs(4, 2, 40, 40, torch.float32, layout="bshd", seed=6)
    be, segments = kernels.BACKENDS["cpu_flash"], (0, 9, 30, 40)
    concatenated = kernels.attention_forward(q, k, v, True, 0.3, be, segments=segments)
    grads = kernels.attention_backward(dout, q, k, v, *concatenated, True, 0.3, be, segments=segments)
    monkeypatch.setattr(segments_module, "CONCAT_ELEMENTS", 0)
    recorder = _OpRecorder()
    with recorder:
        copied = kernels.attention_forward(q, k, v, True, 0.3, be, segments=segments)
        copied_grads = kernels.attention_backward(dout, q, k, v, *copied, True, 0.3, be, segments=segments)
    assert not any("cat" in str(op) for op in recorder.ops), recorder.ops
    for got, want in zip((*copied, *copied_grads), (*concatenated, *grads)):
        assert torch.equal(got, want)


def test_finished_outputs_take_the_queries_memory_layout():
    """Ranks receive each other's rows of out into buffers shaped like their own out: whatever
    layout the last kernel or merge left, finish_forward hands back q's (a copy only then)."""
    from easy_context.core.blocks import finish_forward

    q = torch.randn(1, 6, 4, 8).transpose(1, 2)  # HF's (B, H, S, D) view of (B, S, H, D) memory
    lse = torch.zeros(1, 4, 6)
    kept = torch.randn(1, 6, 4, 8).transpose(1, 2)
    assert finish_forward(q, (kept, lse))[0] is kept
    contiguous = torch.randn(1, 4, 6, 8)  # a concatenation's layout
    out = finish_forward(q, (contiguous, lse))[0]
    assert out.stride() == q.stride() and torch.equal(out, contiguous)
