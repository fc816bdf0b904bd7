"""The memory model: per-rank peak bytes of one training step and its terms (docs/planner.md).
What the attention mode adds (saved tensors, backward buffers, kept outputs) the mode declares
itself (SeqParallelMode.activations)."""

from __future__ import annotations

from easy_context.modes import get_mode
from easy_context.modes.costs import AttentionShape
from recipes.plan.catalogue import GIB, Device, ModelShape, Options
from recipes.plan.sharding import SHARDINGS, Sharding

__all__ = [
    "IN_FLIGHT",
    "activation_terms",
    "attention_shape",
    "attention_transient",
    "default_chunk",
    "default_tile",
    "estimate",
    "host_memory",
    "in_flight",
    "loss_bytes_per_token",
    "offloads_checkpoints",
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


def in_flight(setting: Sharding, model: ModelShape, world: int, a: int) -> dict[str, dict[str, float]]:
    """Bytes besides the states that the setting keeps live, by phase: "loss", "layer" (a
    layer's backward), "end" (the end of the backward; empty where nothing peaks there)."""
    return IN_FLIGHT[setting.gathers](setting, model, world, a)


def _replicated_in_flight(setting: Sharding, model: ModelShape, world: int, a: int) -> dict:
    return {"loss": {}, "layer": {}, "end": {}}  # every weight and gradient is a state already


def _zero3_in_flight(setting: Sharding, model: ModelShape, world: int, a: int) -> dict:
    """Two layers' parameters gathered (the one running and the prefetched one) and two
    layers' gradients in reduce buckets; in the loss, the output layer's weight and its
    gradient bucket. One rank gathers nothing unless its parameters are on the host, and its
    gradients go through buckets only to reach a host optimizer."""
    gather = 0 if world == 1 and not setting.weights_on_host() else 1
    buckets = 1 if gather or setting.optimizer_on_host() else 0
    label = "gathered params / grad buckets"
    return {
        "loss": {label: (gather + buckets) * a * model.embedding_params},
        "layer": {label: (gather + buckets) * 2 * a * model.layer_params},
        "end": {},
    }


def _fsdp2_in_flight(setting: Sharding, model: ModelShape, world: int, a: int) -> dict:
    """train.py's FSDP2 units: gathered copies in the compute dtype (a: the mixed-precision
    policy's bf16, or the fp32 weights), gradients reduce-scattered in the setting's reduce
    dtype. The root (embeddings, final norm, output layer) is not resharded after the forward
    and its gradients are reduced once, after every layer's backward: it stays whole from the
    forward to the end of the step, its output layer's gradient from the loss on."""
    rb = 4 if setting.reduce_dtype == "fp32" else a
    root = model.embedding_params * (1 if model.tied else 2) + model.hidden
    root_label = "root unit gathered (embeddings, final norm, output layer)"
    kept = {root_label: a * root, "output-layer gradient (unsharded)": a * model.embedding_params}
    return {
        "loss": kept,
        "layer": {
            **kept,
            "gathered layers (running + prefetched)": 2 * a * model.layer_params,
            "layer gradients + reduce-scatter input": (a + rb) * model.layer_params,
        },
        "end": {
            root_label: a * root,
            "root gradients (unsharded)": a * root,
            "root reduce-scatter (input + output shard)": rb * root * (1 + 1 / world),
        },
    }


IN_FLIGHT = {"replicated": _replicated_in_flight, "zero3": _zero3_in_flight, "fsdp2": _fsdp2_in_flight}


def _residual_bytes(setting: Sharding, a: int) -> int:
    """Bytes of an element of the residual stream (the layer inputs checkpointing keeps, the
    hidden-state gradients): fp32 where the weights are fp32 (DDP rows: bf16 autocast leaves
    it fp32), else the training dtype's `a`."""
    return 4 if setting.residual_fp32 else a


def offloads_checkpoints(o: Options, device: Device) -> bool:
    """Checkpointed layer inputs go to host memory: checkpointing with offload, on a device
    whose memory is not the host's (train.py offloads nothing on the CPU)."""
    return o.checkpointing and o.offload_checkpoints and not device.memory_is_host


def host_memory(model: ModelShape, seq: int, gpus: int, o: Options, device: Device, dtype: str = "bf16") -> dict:
    """Host (CPU, pinned) memory of one node for what the plan offloads, with its terms per rank
    (docs/planner.md, "Host memory"). Per rank:

      offloaded checkpoints  L x S / sp x h x b   (one layer input per layer; b: the residual
                                                  stream's bytes, memory.py's hb)
      host model states      the setting's host terms (sharding.py), bytes per parameter x N / W
                             where sharded (ZeRO-3 / FSDP2 offload), x N where not

    and a node holds min(gpus, devices per node) ranks. On a device whose memory is the host's
    (cpu) nothing is extra: what these settings keep on the host is in the rank's peak."""
    a = 4 if dtype == "fp32" else 2
    setting = SHARDINGS[o.zero]
    terms = {}
    if not device.memory_is_host:
        if offloads_checkpoints(o, device):
            terms["offloaded checkpoints"] = model.layers * (seq // o.sp) * model.hidden * _residual_bytes(setting, a)
        share = gpus if setting.sharded else 1
        for t in setting.states:
            if t.host:
                terms[t.label] = t.bytes_per_param(a) * model.params / share
    ranks = min(gpus, device.per_node)
    per_rank = sum(terms.values())
    return {"per_node": ranks * per_rank, "per_rank": per_rank, "ranks_per_node": ranks, "terms": terms}


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
    setting = SHARDINGS[o.zero]
    hb = _residual_bytes(setting, a)  # the residual stream: layer inputs kept by checkpointing, hidden grads
    offloaded = offloads_checkpoints(o, device)
    s = seq // o.sp
    L, h = model.layers, model.hidden
    N, W = model.params, gpus
    act = activation_terms(model, o, a)
    attn_t = attention_transient(model, o, a, act["kv_saved"])
    tiled = 0 < o.tiled_mlp < s
    chunk = min(o.loss_chunk, s) if o.loss_chunk else s
    layer_p = model.layer_params

    # --- model states (weights, gradients, optimizer) per rank, and what is in flight besides.
    # Gradients that zero_grad frees between steps (torch optimizers; all of them in the
    # validation's one-step runs) are rebuilt in the backward: an unsharded setting's output
    # layer's from the loss on, a layer's in its backward, all at the end; a sharded setting's
    # shards as each unit reduces, all at the end.
    kept, rebuilt = setting.state_bytes(a, W, device.memory_is_host, persistent_grads)
    states = {label: b * N for label, b in kept.items()}
    rebuilt_grads = sum(rebuilt.values()) * N
    rebuilt_per_param = 0 if setting.sharded else sum(rebuilt.values())
    grad_lm = rebuilt_per_param * model.embedding_params
    grad_layer = rebuilt_per_param * layer_p
    flight = in_flight(setting, model, W, a)
    persistent = device.runtime_gib * GIB + sum(states.values())

    # --- per token, whole step (per local token)
    rope = 2 * model.head_dim * a
    ids = 3 * 8
    hidden_grad = hb * h
    final_norm = 4 * h + 2 * a * h
    if o.checkpointing:
        saved_per_layer = 0 if offloaded else hb * h  # offloaded: host_memory
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
        **flight["loss"],
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
        recompute = act["attn"] + act["mlp_in"] + (0 if tiled else act["mlp"]) + (hb * h if offloaded else 0)
    i = model.active_intermediate
    mlp_tmp = 6 * a * i * min(o.tiled_mlp, s) if tiled else 2 * a * i * s  # tile: recomputed + grads; whole: grads
    common = {
        "runtime": device.runtime_gib * GIB,
        **states,
        **flight["layer"],
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
    if rebuilt_grads or flight["end"]:
        phases["end of backward"] = {
            "runtime": device.runtime_gib * GIB,
            **states,
            **flight["end"],
            "all gradients": rebuilt_grads,
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
