"""The CUDA backends' calls, checked on a machine without a GPU.

* cuda_flash / cuda_efficient run on `meta` tensors against the real aten op schemas, and a
  TorchDispatchMode records the exact arguments they pass.
* cuda_efficient's own logic (GQA repeat and sum, the mask as an aligned bias, the lse padding
  its backward reads, rows with no allowed key) runs on CPU against a stand-in kernel with the
  CUDA kernel's contract, registered as the op's CPU implementation for the test only.
* flash_attn is replaced by fake packages declaring `_flash_attn_backward` the way each
  release line does (a torch.library.custom_op for >= 2.7), computing real values.
* The gating of the flash backends, with the capability lookup mocked.

The check_* helpers take the kernels module so they can be pointed at another version of it.
"""

import contextlib
import inspect
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from kernel_cases import assert_close, inputs, make_mask, reference, window_truth
from torch.utils._python_dispatch import TorchDispatchMode

from easy_context.core import kernels
from easy_context.core.backends import band
from easy_context.core.backends import cuda as cuda_backend
from easy_context.core.backends import flash_attn as flash_attn_backend

aten = torch.ops.aten


class CallRecorder(TorchDispatchMode):
    """Every aten call made inside the `with`, with its arguments as the op received them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)

    def only(self, op) -> dict:
        """The arguments of the one call to `op`, by schema name, defaults filled in."""
        found = [(args, kwargs) for func, args, kwargs in self.calls if func == op]
        assert len(found) == 1, f"expected one call to {op}, got {len(found)}"
        args, kwargs = found[0]
        named = {}
        for i, arg in enumerate(op._schema.arguments):
            if i < len(args) and not arg.kwarg_only:
                named[arg.name] = args[i]
            else:
                named[arg.name] = kwargs.get(arg.name, arg.default_value)
        return named

    def ops(self):
        return {func.overloadpacket for func, _, _ in self.calls}


def meta_inputs(hq, hkv, sq, sk, dtype, d=64):
    """q, k, v, dout on meta, as (B, H, S, D) views of (B, S, H, D)-dense tensors."""
    make = lambda h, s: torch.empty(2, s, h, d, dtype=dtype, device="meta").transpose(1, 2)  # noqa: E731
    return make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq)


# ------------------------------------------------------------------ cuda_flash on meta
def check_cuda_flash_backward_call(module, dtype=torch.bfloat16, hq=8, hkv=8):
    q, k, v, dout = meta_inputs(hq, hkv, 40, 40, dtype)
    with CallRecorder() as rec:
        out, lse = module.cuda_flash_forward(q, k, v, True, 0.125)
        dq, dk, dv = module.cuda_flash_backward(dout, q, k, v, out, lse, True, 0.125)
    call = rec.only(aten._scaled_dot_product_flash_attention_backward.default)
    # Undefined, as the forward returns them: defined ones select the variable-length kernel.
    assert call["cum_seq_q"] is None and call["cum_seq_k"] is None, (call["cum_seq_q"], call["cum_seq_k"])
    return rec, (q, k, v, dout, out, lse), (dq, dk, dv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)])
def test_cuda_flash_calls_match_the_op_schemas(dtype, hq, hkv):
    rec, (q, k, v, dout, out, lse), (dq, dk, dv) = check_cuda_flash_backward_call(cuda_backend, dtype, hq, hkv)
    forward = rec.only(aten._scaled_dot_product_flash_attention.default)
    # GQA native, the strided views as they came
    assert forward["query"] is q and forward["key"] is k and forward["value"] is v
    assert (forward["dropout_p"], forward["is_causal"], forward["return_debug_mask"], forward["scale"]) == (
        0.0,
        True,
        False,
        0.125,
    )
    backward = rec.only(aten._scaled_dot_product_flash_attention_backward.default)
    assert backward["grad_out"] is dout and backward["out"] is out  # the op makes its own layout
    assert (backward["max_q"], backward["max_k"], backward["dropout_p"], backward["is_causal"]) == (40, 40, 0.0, True)
    seed, offset = backward["philox_seed"], backward["philox_offset"]  # as the forward returns them
    assert (seed.shape, seed.dtype, offset.shape, offset.dtype) == ((2,), torch.uint64, (), torch.uint64)
    assert backward["logsumexp"].shape == (2, hq, 40) and backward["scale"] == 0.125
    assert aten.repeat_interleave not in rec.ops()
    assert out.shape == q.shape and lse.shape == (2, hq, 40) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# -------------------------------------------------------------- cuda_efficient on meta
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_efficient_calls_match_the_op_schemas(dtype, hq, hkv, masked):
    sq, sk = 40, 56  # not multiples of 32 / 16: the lse and bias padding matter
    q, k, v, dout = meta_inputs(hq, hkv, sq, sk, dtype)
    mask = torch.empty(2, 1, sq, sk, dtype=torch.bool, device="meta") if masked else None
    causal = False
    be = kernels.BACKENDS["cuda_efficient"]
    assert be.supports_mask
    with CallRecorder() as rec:
        out, lse = be.forward(q, k, v, causal, 0.125, mask)
        dq, dk, dv = be.backward(dout, q, k, v, out, lse, causal, 0.125, mask)
    forward = rec.only(aten._scaled_dot_product_efficient_attention.default)
    backward = rec.only(aten._scaled_dot_product_efficient_attention_backward.default)
    assert forward["query"] is q and forward["key"].shape == forward["value"].shape == (2, hq, sk, 64)
    assert (forward["compute_log_sumexp"], forward["dropout_p"], forward["is_causal"], forward["scale"]) == (
        True,
        0.0,
        causal,
        0.125,
    )
    for bias in (forward["attn_bias"], backward["attn_bias"]):
        if not masked:
            assert bias is None
            continue
        assert bias.shape == (2, hq, sq, sk) and bias.dtype == dtype
        assert bias.stride(-1) == 1 and bias.stride(2) % 16 == 0 and bias.stride(1) == 0
    assert out.shape == q.shape and lse.shape == (2, hq, sq) and lse.dtype == torch.float32
    assert backward["grad_out_"] is dout and backward["query"] is q and backward["key"].shape[1] == hq
    assert backward["out"] is out  # already the kernel's (B, S, H, D) layout: no copy
    assert backward["logsumexp"].shape == (2, hq, 64)  # padded to a multiple of 32 queries
    assert backward["grad_input_mask"] == [True, True, True, False]
    assert (backward["dropout_p"], backward["is_causal"], backward["scale"]) == (0.0, causal, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_cuda_efficient_causal_call_on_meta_with_an_out_in_another_layout():
    q, k, v, dout = meta_inputs(4, 4, 48, 48, torch.float16)
    with CallRecorder() as rec:
        out, lse = cuda_backend.cuda_efficient_forward(q, k, v, True, 0.125)
        cuda_backend.cuda_efficient_backward(dout, q, k, v, out.contiguous(), lse, True, 0.125)
    assert rec.only(aten._scaled_dot_product_efficient_attention.default)["is_causal"] is True
    backward = rec.only(aten._scaled_dot_product_efficient_attention_backward.default)
    assert backward["is_causal"] is True
    assert backward["out"].stride()[2:] == (4 * 64, 1)  # the kernel reads rows H * D apart


# ------------------------------------- cuda_efficient's logic on CPU, against a stand-in kernel
def _round_up(n, to):
    return -(-n // to) * to


def _stand_in_efficient_forward(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """The CUDA op's contract: equal heads, attn_bias (B, H, Sq, Sk) in q's dtype with aligned rows,
    lse padded with +inf to a multiple of 32; rows with no allowed key come out NaN (worst case)."""
    assert q.shape[1] == k.shape[1] == v.shape[1] and compute_log_sumexp and dropout_p == 0.0
    b, h, sq, _ = q.shape
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    if attn_bias is not None:
        assert attn_bias.shape == (b, h, sq, k.shape[2]) and attn_bias.dtype == q.dtype
        assert attn_bias.stride(-1) == 1 and attn_bias.stride(2) % 16 == 0
        scores = scores + attn_bias.double()
    if is_causal:
        scores = scores.masked_fill(~torch.ones(sq, k.shape[2], dtype=torch.bool).tril(), -math.inf)
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse[..., None]) @ v.double()
    padded = torch.full((b, h, _round_up(sq, 32)), math.inf)
    padded[..., :sq] = lse
    out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # the kernel writes (B, S, H, D)
    return out, padded, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)


def _stand_in_efficient_backward(
    grad_out,
    q,
    k,
    v,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    """Uses the lse it is given as the kernel does, padding included: exp(score - lse), so a -inf
    lse would turn into NaN gradients."""
    b, h, sq, _ = q.shape
    assert logsumexp.shape == (b, h, _round_up(sq, 32)) and logsumexp.stride(-1) == 1
    assert out.stride(-1) == 1 and out.stride(2) == h * out.shape[-1]  # read with row stride H * D
    assert (logsumexp[..., sq:] == math.inf).all() and list(grad_input_mask) == [True, True, True, False]
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    if attn_bias is not None:
        scores = scores + attn_bias.double()
    if is_causal:
        scores = scores.masked_fill(~torch.ones(sq, k.shape[2], dtype=torch.bool).tril(), -math.inf)
    probs = torch.exp(scores - logsumexp[..., :sq, None].double())
    dout = grad_out.double()
    delta = (dout * out.double()).sum(-1, keepdim=True)
    ds = probs * (dout @ v.double().transpose(-1, -2) - delta) * scale
    grads = ds @ k.double(), ds.transpose(-1, -2) @ q.double(), probs.transpose(-1, -2) @ dout
    return *(g.to(q.dtype) for g in grads), None


@pytest.fixture
def stand_in_efficient_op():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_efficient_attention", _stand_in_efficient_forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", _stand_in_efficient_backward, "CPU")
    yield
    lib._destroy()


# The stand-in computes in float64 and rounds, so fp32 errors are rounding only (measured: out
# 1.2e-7, lse 2.4e-7, grads 2.2e-7 of their scale) and its fp32 lse is that whatever the dtype.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("hq,hkv,sq,sk", [(4, 4, 40, 40), (4, 2, 24, 56), (4, 1, 72, 40)])
@pytest.mark.parametrize("kind", [None, "causal", "random", "block_diagonal", "key_padding"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cuda_efficient_logic_against_a_stand_in_kernel(
    stand_in_efficient_op, dtype, tol, hq, hkv, sq, sk, kind, layout
):
    q, k, v, dout = inputs(hq, hkv, sq, sk, dtype, layout=layout, seed=2)
    causal = kind == "causal" and sq == sk
    mask = make_mask(kind, sq, sk) if kind and not causal else None
    be = kernels.BACKENDS["cuda_efficient"]
    out, lse = kernels.attention_forward(q, k, v, causal, 0.3, be, mask=mask)
    if layout == "bhsd":  # an out in another layout than the kernel's own (e.g. a received one)
        out = out.contiguous()
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, causal, 0.3, be, mask=mask)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, causal, 0.3, mask)
    ref_out.backward(dout.double())
    assert_close(out, ref_out, tol)
    assert_close(lse, ref_lse, 2e-6)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert_close(got, want, tol * max(1.0, want.abs().max().item()))


# ------------------------------------------------------------------ fake flash_attn
def _window(sq, sk, window):
    """flash_attn's window rule as a bool (Sq, Sk) mask, None for no window."""
    return None if tuple(window) == (-1, -1) else window_truth(sq, sk, tuple(window))


def _reference_grads_into(dout, q, k, v, softmax_scale, causal, dq, dk, dv, window=(-1, -1)):
    """(B, S, H, D) in, like flash_attn: float64 gradients written into dq/dk/dv. Closed form,
    since autograd is off inside an op's kernel."""
    t = lambda x: x.transpose(1, 2).double()  # noqa: E731
    n_kv, rep = k.shape[2], q.shape[2] // k.shape[2]
    qd, kd, vd, dod = t(q), t(k).repeat_interleave(rep, 1), t(v).repeat_interleave(rep, 1), t(dout)
    scores = qd @ kd.transpose(-1, -2) * softmax_scale
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    allowed = _window(q.shape[1], k.shape[1], window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    probs = scores.softmax(-1)
    ds = probs * (dod @ vd.transpose(-1, -2) - (dod * (probs @ vd)).sum(-1, keepdim=True)) * softmax_scale
    per_kv_head = lambda g: g.unflatten(1, (n_kv, rep)).sum(2)  # noqa: E731
    grads = ds @ kd, per_kv_head(ds.transpose(-1, -2) @ qd), per_kv_head(probs.transpose(-1, -2) @ dod)
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad.transpose(1, 2))


def fake_flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    assert q.stride(-1) == 1 and dropout_p == 0.0
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse = reference(t(q), t(k), t(v), causal, softmax_scale, _window(q.shape[1], k.shape[1], window_size))
    out = t(out).to(q.dtype).contiguous()  # flash_attn returns (B, S, H, D)
    return (out, lse.float(), torch.empty(0, dtype=q.dtype)) if return_attn_probs else out


# Declared as flash_attn 2.8.3 declares its backward (under a test namespace, not flash_attn's).
@torch.library.custom_op("easy_context_tests::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def flash_attn_2_8_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    assert (dropout_p, softcap, alibi_slopes) == (0.0, 0.0, None)
    _reference_grads_into(dout, q, k, v, softmax_scale, causal, dq, dk, dv, (window_size_left, window_size_right))
    return torch.zeros(q.shape[0], q.shape[2], q.shape[1])  # softmax_d


def flash_attn_2_6_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    assert (dropout_p, softcap, alibi_slopes) == (0.0, 0.0, None)
    _reference_grads_into(dout, q, k, v, softmax_scale, causal, dq, dk, dv, window_size)


def flash_attn_2_0_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, rng_state=None
):
    assert dropout_p == 0.0
    _reference_grads_into(dout, q, k, v, softmax_scale, causal, dq, dk, dv)


@contextlib.contextmanager
def fake_flash_attn(backward, module=flash_attn_backend):
    """`flash_attn` and `flash_attn.flash_attn_interface` in sys.modules, for `module`'s lookups."""
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.flash_attn_func, interface._flash_attn_backward = fake_flash_attn_func, backward
    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = interface
    saved = {name: sys.modules.get(name) for name in (package.__name__, interface.__name__)}
    names = ("_flash_attn_module", "flash_attn_usable", "flash_attn_has_softcap", "flash_attn_has_window")
    caches = [getattr(module, n) for n in names]
    sys.modules.update({package.__name__: package, interface.__name__: interface})
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
        for cache in caches:
            cache.cache_clear()


def check_flash_attn_backend(module, backward, dtype=torch.float32, hq=4, hkv=2, causal=True):
    q, k, v, dout = inputs(hq, hkv, 32, 32, dtype, layout="bshd", seed=3)
    be = module.BACKENDS["flash_attn"]
    with fake_flash_attn(backward):
        out, lse = module.attention_forward(q, k, v, causal, 0.3, be)
        dq, dk, dv = module.attention_backward(dout, q, k, v, out, lse, causal, 0.3, be)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, _ = reference(qr, kr, vr, causal, 0.3)
    ref_out.backward(dout.double())
    tol = 1e-6 if dtype == torch.float32 else 3e-2  # the fakes compute in float64: fp32 measured 4.6e-8
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize(
    "backward", [flash_attn_2_8_backward, flash_attn_2_6_backward, flash_attn_2_0_backward], ids=["2.8", "2.6", "2.0"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,causal", [(4, 2, True), (4, 4, False)])
def test_flash_attn_backward_passes_through_each_release_signature(backward, dtype, hq, hkv, causal):
    check_flash_attn_backend(kernels, backward, dtype, hq, hkv, causal)


def test_flash_attn_gets_the_softcap_in_both_directions_where_the_release_has_it():
    """flash_attn >= 2.6 softcaps in its kernels: the value reaches both calls. Older releases
    (2.0 here) have no softcap: a softcapped call never picks flash_attn."""
    seen = {}

    def forward(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        seen["forward"] = softcap
        return fake_flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True)

    def backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        seen["backward"] = softcap

    q, k, v, dout = inputs(4, 2, 16, 16, torch.float16, layout="bshd")
    be = kernels.BACKENDS["flash_attn"]
    with fake_flash_attn(backward):
        sys.modules["flash_attn.flash_attn_interface"].flash_attn_func = forward
        assert kernels._has("flash_attn", masked=False, softcap=True)
        out, lse = kernels.attention_forward(q, k, v, True, 0.3, be, softcap=30.0)
        kernels.attention_backward(dout, q, k, v, out, lse, True, 0.3, be, softcap=30.0)
    assert seen == {"forward": 30.0, "backward": 30.0}
    with fake_flash_attn(flash_attn_2_0_backward):
        assert not kernels._has("flash_attn", masked=False, softcap=True)
        assert kernels._has("flash_attn", masked=False, softcap=False)


def test_flash_attn_signature_is_read_from_the_custom_op_schema_once():
    # What broke the old lookup: a CustomOpDef's Python signature names nothing.
    assert type(flash_attn_2_8_backward).__name__ == "CustomOpDef"
    assert str(inspect.signature(flash_attn_2_8_backward)) == "(*args, **kwargs)"
    names = flash_attn_backend.parameter_names(flash_attn_2_8_backward)
    assert {"window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic"} <= names
    flash_attn_backend.flash_attn_backward_options.cache_clear()
    check_flash_attn_backend(kernels, flash_attn_2_8_backward)
    misses = flash_attn_backend.flash_attn_backward_options.cache_info().misses
    check_flash_attn_backend(kernels, flash_attn_2_8_backward)
    assert flash_attn_backend.flash_attn_backward_options.cache_info().misses == misses == 1


# ------------------------------------------------------------------------- gating
@pytest.fixture
def cuda_lookups(monkeypatch):
    """flash_attn importable, torch built with flash attention, flex compilable (Triton);
    caches cleared around the test."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(kernels, "flex_compilable", lambda: True)
    kernels._usable_backends.cache_clear()
    with fake_flash_attn(flash_attn_2_8_backward):
        yield
    kernels._usable_backends.cache_clear()


def test_cuda_backend_order(cuda_lookups):
    available = kernels.available_backends
    everything = ["flash_attn", "cuda_flash", "cuda_efficient", "flex", "math"]
    assert available("cuda", torch.bfloat16, 128, (8, 0)) == everything
    assert available("cuda", torch.float16, 72, (9, 0)) == everything  # 72: a multiple of 8
    assert available("cuda", torch.float16, 256, (12, 0)) == everything
    assert available("cuda", torch.float32, 64, (8, 0)) == ["cuda_efficient", "flex", "math"]  # never math first
    assert available("cuda", torch.float64, 64, (8, 0)) == ["math"]
    assert available("cuda", torch.bfloat16, 128, (8, 0), masked=True) == ["cuda_efficient", "flex", "math"]


def test_masked_or_softcapped_cuda_calls_no_fused_kernel_serves_go_to_flex(cuda_lookups, monkeypatch):
    available = kernels.available_backends
    assert available("cuda", torch.bfloat16, 128, (8, 0), softcap=True) == ["flash_attn", "flex", "math"]
    for dtype in (torch.bfloat16, torch.float32):
        assert available("cuda", dtype, 128, (8, 0), masked=True, softcap=True) == ["flex", "math"]
    assert available("cuda", torch.float32, 64, (8, 0), softcap=True) == ["flex", "math"]
    # Outside what it is used for (fp64, sm75, head dims 8 or 264) and without Triton: math.
    assert available("cuda", torch.float64, 64, (8, 0), masked=True, softcap=True) == ["math"]
    assert available("cuda", torch.float16, 64, (7, 5), masked=True, softcap=True) == ["math"]
    assert available("cuda", torch.float32, 8, (8, 0), masked=True, softcap=True) == ["math"]
    assert available("cuda", torch.bfloat16, 264, (9, 0), masked=True, softcap=True) == ["math"]
    monkeypatch.setattr(kernels, "flex_compilable", lambda: False)
    assert available("cuda", torch.bfloat16, 128, (8, 0), masked=True, softcap=True) == ["math"]


@pytest.mark.parametrize(
    "head_dim,capability", [(64, (7, 5)), (72, (7, 5)), (70, (8, 0)), (264, (8, 0)), (264, (9, 0))]
)
def test_flash_backends_need_sm80_and_a_head_dim_they_are_built_for(cuda_lookups, head_dim, capability):
    names = kernels.available_backends("cuda", torch.float16, head_dim, capability)
    assert "flash_attn" not in names and "cuda_flash" not in names
    assert names[-1] == "math"
    assert ("cuda_efficient" in names) == (head_dim % 8 == 0)  # half: GEMM alignment 8
    assert "flex" not in names  # its window: sm80+, head dims 16..256 in multiples of 8


def test_efficient_backend_limits(cuda_lookups):
    available = kernels.available_backends
    assert available("cuda", torch.bfloat16, 64, (7, 5)) == ["math"]  # bf16 kernels are sm80+
    assert available("cuda", torch.float32, 70, (7, 0)) == ["cuda_efficient", "math"]  # no tensor cores, no flex
    assert available("cuda", torch.float32, 70, (8, 0)) == ["math"]  # tensor cores: alignment 4


def test_capability_is_queried_once_per_device(cuda_lookups, monkeypatch):
    queried = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: queried.append(index) or (7, 5))
    fake_q = lambda dtype, head_dim, index=0: SimpleNamespace(  # noqa: E731  (what select_backend reads)
        device=torch.device("cuda", index), dtype=dtype, shape=(1, 8, 128, head_dim)
    )
    for _ in range(3):
        assert kernels.select_backend(fake_q(torch.float16, 64)).name == "cuda_efficient"
    assert kernels.select_backend(fake_q(torch.float32, 64)).name == "cuda_efficient"
    assert queried == [0, 0]  # once per (device, dtype, head dim), never per call
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 6))
    assert kernels.select_backend(fake_q(torch.float16, 64, index=1)).name == "flash_attn"
    assert kernels.select_backend(fake_q(torch.float16, 64, index=1), masked=True).name == "cuda_efficient"
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "cuda_flash")
    assert kernels.select_backend(fake_q(torch.float16, 64, index=1)).name == "cuda_flash"
    assert kernels.select_backend(fake_q(torch.float16, 64, index=1), masked=True).name == "cuda_efficient"
    with pytest.raises(ValueError, match="usable here"):
        kernels.select_backend(fake_q(torch.float16, 64))  # sm75: no flash


@pytest.mark.parametrize("backward", [flash_attn_2_8_backward, flash_attn_2_6_backward], ids=["2.8", "2.6"])
@pytest.mark.parametrize("window", [(9, 0), (13, -1), (4, 3)])
def test_flash_attn_runs_windows_natively_in_both_directions(backward, window):
    """A window block goes to flash_attn's own window (releases >= 2.3), no mask built."""
    q, k, v, dout = inputs(4, 2, 24, 40, torch.float32, layout="bshd", seed=5)
    be = kernels.BACKENDS["flash_attn"]
    with fake_flash_attn(backward):
        out, lse = kernels.attention_forward(q, k, v, False, 0.3, be, window=window)
        grads = kernels.attention_backward(dout, q, k, v, out, lse, False, 0.3, be, window=window)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, False, 0.3, window_truth(24, 40, window))
    ref_out.backward(dout.double())
    assert_close(out, ref_out, 1e-6)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert_close(got, want, 1e-6 * max(1.0, want.abs().max().item()))


def test_flash_attn_releases_without_windows_are_not_given_one():
    with fake_flash_attn(flash_attn_2_0_backward):
        assert not flash_attn_backend.flash_attn_has_window()


def test_cuda_flash_window_calls_match_the_op_schemas():
    """A window goes to the flash op under SDPA's, which takes window_size_left/right, in the
    (B, S, H, D) layout HF's tensors are transposes of (no copies)."""
    q, k, v, dout = meta_inputs(8, 2, 40, 72, torch.bfloat16)
    with CallRecorder() as rec:
        out, lse = cuda_backend.cuda_flash_forward(q, k, v, False, 0.125, window=(31, 0))
        dq, dk, dv = cuda_backend.cuda_flash_backward(dout, q, k, v, out, lse, False, 0.125, window=(31, 0))
    forward = rec.only(aten._flash_attention_forward.default)
    assert forward["query"].shape == (2, 40, 8, 64) and forward["key"].shape == (2, 72, 2, 64)
    assert forward["query"].stride(-1) == 1 and forward["cum_seq_q"] is None
    assert (forward["max_q"], forward["max_k"], forward["is_causal"], forward["scale"]) == (40, 72, False, 0.125)
    assert (forward["window_size_left"], forward["window_size_right"]) == (31, 0)
    backward = rec.only(aten._flash_attention_backward.default)
    assert (backward["window_size_left"], backward["window_size_right"], backward["is_causal"]) == (31, 0, False)
    assert backward["cum_seq_q"] is None and backward["logsumexp"].shape == (2, 8, 40)
    assert aten.repeat_interleave not in rec.ops()
    assert out.shape == q.shape and lse.shape == (2, 8, 40)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("causal,window", [(True, None), (False, (15, 0))])
def test_cuda_flash_documents_take_the_variable_length_call(causal, window):
    """Packed documents of one batch row: one call of the op's variable-length path, on (S, H, D)
    views of HF's tensors with int32 cu_seqlens from the segments; its (H, S) lse comes back as
    (1, H, S). Several batch rows: a call per document."""
    q, k, v, dout = (x[:1] for x in meta_inputs(8, 2, 40, 40, torch.bfloat16))
    segments = (0, 3, 31, 40)
    with CallRecorder() as rec:
        out, lse = cuda_backend.cuda_flash_forward(q, k, v, causal, 0.125, window=window, segments=segments)
        dq, dk, dv = cuda_backend.cuda_flash_backward(
            dout, q, k, v, out, lse, causal, 0.125, window=window, segments=segments
        )
    forward = rec.only(aten._flash_attention_forward.default)
    assert forward["query"].shape == (40, 8, 64) and forward["key"].shape == (40, 2, 64)
    assert forward["query"].stride(-1) == 1 and forward["query"].data_ptr() == q.data_ptr()
    cu = forward["cum_seq_q"]
    assert cu.dtype == torch.int32 and cu.shape == (4,) and forward["cum_seq_k"] is cu
    assert (forward["max_q"], forward["max_k"], forward["is_causal"]) == (28, 28, causal)
    assert (forward["window_size_left"], forward["window_size_right"]) == (window or (None, None))
    backward = rec.only(aten._flash_attention_backward.default)
    assert backward["cum_seq_q"] is cu and backward["logsumexp"].shape == (8, 40) and backward["is_causal"] == causal
    assert (backward["window_size_left"], backward["window_size_right"]) == (window or (None, None))
    assert out.shape == q.shape and lse.shape == (1, 8, 40)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    # the cu_seqlens of a mask's kernel calls are built once: every layer and the backward reuse them
    assert cuda_backend.cu_seqlens(segments, q.device) is cu
    q2, k2, v2, _ = meta_inputs(8, 2, 40, 40, torch.bfloat16)
    with CallRecorder() as rec:
        cuda_backend.cuda_flash_forward(q2, k2, v2, causal, 0.125, window=window, segments=segments)
    flash_calls = [(f, a) for f, a, _ in rec.calls if "flash" in str(f)]
    assert len(flash_calls) == 3  # one per document, each a dense call of its batch rows
    assert all(a[0].dim() == 4 and a[0].shape[0] == 2 for _, a in flash_calls)


@pytest.mark.parametrize("window", [(20, 0), (9, 4), (30, -1), (-1, 6)])
@pytest.mark.parametrize("hq,hkv,sq,sk", [(4, 2, 96, 96), (4, 4, 64, 120), (4, 2, 100, 70)])
def test_cuda_efficient_window_computes_only_the_band(monkeypatch, stand_in_efficient_op, window, hq, hkv, sq, sk):
    """fp32 windows (no flash kernel): cuda_efficient runs the band in tiles of rows, each tile's
    bias covering only the keys its rows reach (more queries than keys: the window as a mask,
    rows may be empty), and matches the reference in both directions."""
    monkeypatch.setattr(band, "BAND_TILE_ROWS", 16)
    monkeypatch.setattr(band, "BAND_WHOLE_PRODUCTS", 0)
    q, k, v, dout = inputs(hq, hkv, sq, sk, torch.float32, layout="bshd", seed=5)
    be, scale = kernels.BACKENDS["cuda_efficient"], 0.3
    recorder = CallRecorder()
    with recorder:
        out, lse = kernels.attention_forward(q, k, v, False, scale, be, window=window)
        dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, False, scale, be, window=window)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, False, scale, window_truth(sq, sk, window))
    ref_out.backward(dout.double())
    assert_close(out, ref_out, 2e-6)
    assert_close(lse, ref_lse, 2e-6)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert_close(got, want, 2e-6 * max(1.0, want.abs().max().item()))
    products = [
        args[3].shape[-2] * args[3].shape[-1] if args[3] is not None else sq * sk
        for func, args, _ in recorder.calls
        if func == aten._scaled_dot_product_efficient_attention.default
    ]
    left, right = window
    if sq > sk:
        assert products == [sq * sk]
    elif left >= 0 and right >= 0:  # a band bounded on both sides: a tile's rows plus the band's width
        assert len(products) > 1 and sum(products) <= sq * (band.BAND_TILE_ROWS + left + right), products
    else:  # unbounded on one side: the triangle the window leaves out is still skipped
        assert len(products) > 1 and sum(products) < sq * sk, products


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 3), (4, 4)])
def test_cuda_efficient_decoding_step_reads_the_cache_as_it_is(stand_in_efficient_op, masked, hq, hkv):
    """A decoding step (one query row) with GQA: the query heads of a K/V head become rows of it,
    so nothing the size of the cache is made per layer per token (no K/V repeat, one bias row per
    batch row); out and lse are the reference's (a left-padded row: its padding masked out)."""
    sk = 56
    q, k, v, _ = inputs(hq, hkv, 1, sk, torch.float32, layout="bshd", seed=6)
    mask = torch.ones(2, 1, 1, sk, dtype=torch.bool)
    mask[1, ..., :19] = False  # batch row 1 is left-padded
    mask = mask if masked else None
    be = kernels.BACKENDS["cuda_efficient"]
    with CallRecorder() as rec:
        out, lse = kernels.attention_forward(q, k, v, False, 0.3, be, mask=mask)
    kernel = rec.only(aten._scaled_dot_product_efficient_attention.default)
    assert kernel["key"] is k and kernel["value"] is v  # the cache shard as it is
    assert aten.repeat_interleave not in rec.ops()
    if masked:
        bias = kernel["attn_bias"]
        assert bias.shape == (2, hkv, hq // hkv, sk) and bias.stride(1) == 0
        assert hq == hkv or bias.stride(2) == 0  # folded heads share the bias row
    qr, kr, vr = (x.double() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, False, 0.3, mask)
    assert_close(out, ref_out, 2e-6)
    assert_close(lse, ref_lse, 2e-6)
