"""The memory model: per-rank peak bytes of one training step and its terms (docs/planner.md).
What the attention mode adds (saved tensors, backward buffers, kept outputs) the mode declares
itself (SeqParallelMode.activations)."""

from __future__ import annotations

from easy_context.modes import get_mode
from easy_context.modes.costs import AttentionShape
from easy_context.programs.plan.catalogue import GIB, Device, ModelShape, Options

__all__ = [
    "activation_terms",
    "attention_shape",
    "attention_transient",
    "default_chunk",
    "default_tile",
    "estimate",
    "loss_bytes_per_token",
]


def default_tile(model: ModelShape) -> int:
    """MLP tile: about hidden_size tokens (ALST's choice), at least 1024."""
    return max(1024, 1 << (model.hidden - 1).bit_length())


def default_chunk(model: ModelShape) -> int:
    """Loss chunk: the largest power of two whose fp32 logits and their gradients (12 B per
    token per vocabulary entry) stay within 2 GiB, 1024..8192 tokens."""
    c = 2 * GIB // (12 * model.vocab)
    return int(min(8192, max(1024, 1 << (max(1, c).bit_length() - 1))))


def attention_shape(model: ModelShape, o: Options, a: int, seq: int = 0) -> AttentionShape:
    """One attention layer of `model` under options `o`, batch 1, `a` bytes per activation
    element (seq: the sequence length, where the question is not per token)."""
    return AttentionShape(model.heads, model.kv_heads, model.head_dim, a, o.sp, o.ring_degree, seq)


# ---------------------------------------------------------------------- memory model
def activation_terms(model: ModelShape, o: Options, a: int) -> dict:
    """Bytes per local token (and per layer where named so) that autograd keeps, derived from
    what each op saves for backward and checked against torch's saved-tensor hooks on a
    Llama decoder layer (fp32 and bf16, three shapes: docs/planner.md). The mode's part:
    SeqParallelMode.activations (under "mode")."""
    h, q, kv, i = model.hidden, model.q, model.kv, model.active_intermediate
    mode = get_mode(o.mode).activations(attention_shape(model, o, a))
    kv_saved = kv * mode.kv_replication
    norm = 4 * h + 2 * a * h + 4  # RMSNorm: fp32 input, normalized, output (+ rsqrt)
    attn = norm + a * (q + 2 * kv_saved) + a * q + 4 * model.heads + mode.saved  # q,k,v after RoPE; output; fp32 lse
    mlp_in = norm
    mlp = 4 * a * i  # gate, act(gate), up, act*up
    return {"rep": mode.kv_replication, "kv_saved": kv_saved, "attn": attn, "mlp_in": mlp_in, "mlp": mlp, "mode": mode}


def attention_transient(model: ModelShape, o: Options, a: int, kv_saved: int) -> int:
    """Bytes per local token live during one layer's attention backward (its largest phase):
    the kernel's gradients and the mode's buffers."""
    q = model.q
    kernel = 4 * q + a * (q + 2 * kv_saved)  # fp32 dq accumulation + dq, dk, dv
    return kernel + get_mode(o.mode).activations(attention_shape(model, o, a)).backward_buffers


def loss_bytes_per_token(model: ModelShape, a: int) -> int:
    """One chunk: fp32 log-softmax output, its gradient and the NLL gradient (+ the bf16 logits
    or their gradient when the activations are not fp32)."""
    return model.vocab * (12 + (a if a < 4 else 0))


def estimate(
    model: ModelShape,
    seq: int,
    gpus: int,
    o: Options,
    device: Device,
    dtype: str = "bf16",
    persistent_grads: bool = True,
) -> dict:
    """Per-rank peak memory (bytes) of one training step, with its terms, for options `o`."""
    a = 4 if dtype == "fp32" else 2
    # the residual stream (layer inputs kept by checkpointing, hidden-state gradients): fp32
    # where the weights are fp32 (DDP rows: bf16 autocast leaves it fp32), else the dtype
    hb = 4 if o.zero in ("none", "noopt") else a
    s = seq // o.sp
    L, h = model.layers, model.hidden
    N, W = model.params, gpus
    act = activation_terms(model, o, a)
    attn_t = attention_transient(model, o, a, act["kv_saved"])
    tiled = 0 < o.tiled_mlp < s
    chunk = min(o.loss_chunk, s) if o.loss_chunk else s
    layer_p = model.layer_params

    # --- model states (weights, gradients, optimizer) per rank
    states = {}
    if o.zero in ("none", "noopt"):
        wb = 4  # fp32 weights (autocast for bf16), fp32 gradients
        states["weights"] = wb * N
        if o.zero == "none":
            states["gradients"] = 4 * N
            states["optimizer (Adam m, v)"] = 8 * N
        elif persistent_grads:
            states["gradients"] = 4 * N
        grad_lm = 0 if "gradients" in states else wb * model.embedding_params
        grad_layer = 0 if "gradients" in states else wb * layer_p
        gathered_lm = gathered_layers = 0
    else:
        gather = 0 if (W == 1 and o.zero != "zero3-offload") else 1  # a full copy needs no gathering
        buckets = 1 if (gather or o.zero != "zero3") else 0  # gradients leave through buckets
        if o.zero == "zero3":
            states["params (bf16 shard)"] = 2 * N / W
            states["gradients (bf16 shard)"] = 2 * N / W
            states["optimizer (fp32 master, m, v shard)"] = 12 * N / W
        elif o.zero == "zero3-opt-offload":
            states["params (bf16 shard)"] = 2 * N / W
        # gathered parameters and gradient buckets in flight (stage-3 prefetch + reduce)
        gathered_layers = gather * 2 * (2 * layer_p) + buckets * 2 * (2 * layer_p)  # 2 layers, bf16
        gathered_lm = (gather + buckets) * 2 * model.embedding_params
        grad_lm = grad_layer = 0
    persistent = device.runtime_gib * GIB + sum(states.values())

    # --- per token, whole step (per local token)
    rope = 2 * model.head_dim * a
    ids = 3 * 8
    hidden_grad = hb * h
    final_norm = 4 * h + 2 * a * h
    if o.checkpointing:
        saved_per_layer = 0 if o.offload_checkpoints else hb * h
        saved_layers = L * saved_per_layer
    else:
        saved_layers = L * (act["attn"] + act["mlp_in"] + (0 if tiled else act["mlp"]))
    remat = L * act["mode"].kept_for_recompute if o.checkpointing else 0
    loss_tok = loss_bytes_per_token(model, a)

    phases = {}
    # F: the loss, at the start of the backward: every layer's saved tensors, the final norm's,
    # one chunk of logits with its gradients, the output layer's gradient (or gathered weight).
    phases["loss"] = {
        "runtime": device.runtime_gib * GIB,
        **states,
        "gathered params / grad buckets": gathered_lm,
        "output-layer gradient": grad_lm,
        "saved activations (all layers)": saved_layers * s,
        "attention outputs kept for the recompute (dist_flash)": remat * s,
        "final norm + hidden grad + RoPE + ids": (final_norm + hidden_grad + rope + ids) * s,
        "logits + loss (one chunk)": loss_tok * chunk,
    }
    # B: the backward of the last layer (recomputed under checkpointing): its MLP part, then
    # its attention part with the mode's buffers.
    recompute = 0
    if o.checkpointing:
        recompute = (
            act["attn"] + act["mlp_in"] + (0 if tiled else act["mlp"]) + (hb * h if o.offload_checkpoints else 0)
        )
    i = model.active_intermediate
    mlp_tmp = 6 * a * i * min(o.tiled_mlp, s) if tiled else 2 * a * i * s  # tile: recomputed + grads; whole: grads
    common = {
        "runtime": device.runtime_gib * GIB,
        **states,
        "gathered params / grad buckets": gathered_layers,
        "output-layer + layer gradients": grad_lm + grad_layer,
        "saved activations (all layers)": saved_layers * s,
        "attention outputs kept for the recompute (dist_flash)": remat * s,
        "recomputed layer": recompute * s,
        "hidden grads + RoPE + ids": (2 * hidden_grad + rope + ids) * s,
    }
    phases["layer backward: MLP"] = {**common, "MLP transient (tile or whole)": mlp_tmp}
    attn_part = dict(common)
    attn_part["recomputed layer"] = (
        (recompute - (act["mlp_in"] + (0 if tiled else act["mlp"]))) * s if o.checkpointing else recompute * s
    )
    if not o.checkpointing:  # the MLP's saved tensors of the last layer are freed by now
        attn_part["saved activations (all layers)"] -= (act["mlp_in"] + (0 if tiled else act["mlp"])) * s
    attn_part["attention transient (mode)"] = attn_t * s
    phases["layer backward: attention"] = attn_part
    if not persistent_grads or o.zero == "noopt":
        phases["end of backward"] = {
            "runtime": device.runtime_gib * GIB,
            **states,
            "all gradients": 4 * N,
            "hidden grads + RoPE + ids": (2 * hidden_grad + rope + ids) * s,
        }
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=totals.get)
    return {
        "peak_bytes": totals[peak_phase],
        "peak_phase": peak_phase,
        "terms": {k: v for k, v in phases[peak_phase].items() if v},
        "phases": totals,
        "local_tokens": s,
        "loss_chunk": chunk,
        "tiled": tiled,
        "persistent": persistent,
    }
