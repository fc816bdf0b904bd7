"""Plan a long-context training run: per-rank peak memory and a throughput estimate for every
feasible mode x memory-option combination, and a recommendation.

    python -m easy_context.plan --model llama-3-8b --seq-length 524288 --gpus 8 --gpu h100-80g
    python -m easy_context.plan --model configs/tiny-llama --seq-length 65536 --gpus 2 --gpu cpu --json

The model is analytic (no tensors are allocated); docs/planner.md states every term, the
roofline, the assumptions and how the model compares with measured and published runs.
Plain Python arithmetic; transformers is imported only to read a config that is not a preset.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Optional

__all__ = ["ModelShape", "Device", "Options", "PRESETS", "DEVICES", "load_model", "get_device", "estimate",
           "plan", "PlanError", "main"]

GIB, MIB = 2 ** 30, 2 ** 20


class PlanError(ValueError):
    """Bad input or nothing fits; the message says what would work."""


# ----------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    experts: int = 1              # routed experts per MoE layer (1: dense MLP)
    experts_per_token: int = 1

    @property
    def q(self) -> int:           # query (and attention output) width
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:          # key (= value) width
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        attn = self.hidden * (self.q + 2 * self.kv) + self.q * self.hidden
        mlp = 3 * self.hidden * self.intermediate * self.experts + (self.hidden * self.experts if self.experts > 1 else 0)
        return attn + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params * (1 if self.tied else 2) + self.hidden

    @property
    def active_intermediate(self) -> int:   # MLP width a token goes through
        return self.intermediate * self.experts_per_token

    @property
    def matmul_params_per_token(self) -> int:
        """Weights a token multiplies with (2 FLOPs each in the forward): layers + output layer."""
        attn = self.hidden * (self.q + 2 * self.kv) + self.q * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.active_intermediate) + self.vocab * self.hidden


# Published configs (config.json of the hub checkpoints).
PRESETS = {
    "llama-2-7b": ModelShape("llama-2-7b", 4096, 11008, 32, 32, 32, 128, 32000),
    "llama-2-13b": ModelShape("llama-2-13b", 5120, 13824, 40, 40, 40, 128, 32000),
    "llama-3-8b": ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256),
    "llama-3-70b": ModelShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256),
    "mistral-7b": ModelShape("mistral-7b", 4096, 14336, 32, 32, 8, 128, 32000),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 3584, 18944, 28, 28, 4, 128, 152064),
    # scripts/bench_train.py's model (what the CPU validation measures)
    "tiny-bench": ModelShape("tiny-bench", 256, 688, 4, 4, 2, 64, 32000),
}
PRESETS["llama-3.1-8b"] = replace(PRESETS["llama-3-8b"], name="llama-3.1-8b")


def shape_from_config(config, name: str) -> ModelShape:
    config = getattr(config, "text_config", None) or config
    get = lambda *keys, default=None: next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), default)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if not hidden or not heads or not get("num_hidden_layers") or not get("vocab_size"):
        raise PlanError(f"{name}: the config has no hidden_size / num_attention_heads / num_hidden_layers / vocab_size")
    experts = get("num_local_experts", "num_experts", "n_routed_experts", default=1) or 1
    inter = get("moe_intermediate_size", default=None) if experts > 1 else None
    return ModelShape(
        name=name, hidden=hidden, intermediate=inter or get("intermediate_size", default=4 * hidden),
        layers=get("num_hidden_layers"), heads=heads, kv_heads=get("num_key_value_heads", default=heads),
        head_dim=get("head_dim", default=hidden // heads), vocab=get("vocab_size"),
        tied=bool(get("tie_word_embeddings", default=False)), experts=experts,
        experts_per_token=get("num_experts_per_tok", "num_experts_per_token", default=1) if experts > 1 else 1)


def load_model(name: str) -> ModelShape:
    """A preset name, a local config dir / config.json, or a hub name already in the local cache."""
    if name.lower() in PRESETS:
        return PRESETS[name.lower()]
    try:
        from transformers import AutoConfig
    except ImportError as error:  # pragma: no cover
        raise PlanError(f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}) and transformers is missing") from error
    path = name
    if os.path.isfile(path):
        path = os.path.dirname(path) or "."
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=not os.environ.get("EASY_CONTEXT_PLAN_ONLINE"))
    except Exception as error:  # OSError, ValueError, EnvironmentError from the hub client
        raise PlanError(
            f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}), not a local config folder, and not a hub "
            f"model in the local cache ({type(error).__name__}: {str(error).splitlines()[0][:160]}); set "
            "EASY_CONTEXT_PLAN_ONLINE=1 to look it up on the hub") from None
    return shape_from_config(config, name)


# ---------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    tflops: float            # dense bf16 peak (fp32 for cpu), per device
    link_gbs: float          # per-device bandwidth to the other devices of its node, one direction
    network_gbs: float       # per-device bandwidth across nodes
    pcie_gbs: float          # host <-> device copies
    runtime_gib: float       # CUDA context, NCCL and cuBLAS workspaces (cpu: interpreter + torch + transformers)
    per_node: int = 8
    optimizer_params_per_s: float = 5e8   # CPU Adam (offloaded optimizer), per rank


def _cpu_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) / 2 ** 20
    except OSError:  # pragma: no cover
        return 16.0


DEVICES = {
    "a100-40g": Device("a100-40g", 40.0, 312.0, 300.0, 25.0, 25.0, 2.0),
    "a100-80g": Device("a100-80g", 80.0, 312.0, 300.0, 25.0, 25.0, 2.0),
    "h100-80g": Device("h100-80g", 80.0, 989.0, 450.0, 50.0, 50.0, 2.0),
    "h200": Device("h200", 140.0, 989.0, 450.0, 50.0, 50.0, 2.0),
    # The CPU machine the validation runs on: one process per rank, fp32, gloo. Runtime =
    # RSS of a rank before the step minus its weights (docs/bench_train.csv: 392-397 MiB).
    "cpu": Device("cpu", 0.0, 0.1, 5.0, 1.0, 1000.0, 395 / 1024, per_node=1 << 20, optimizer_params_per_s=2e8),
}
DEVICES["h100"] = DEVICES["h100-80g"]
DEVICES["a100"] = DEVICES["a100-80g"]


def get_device(name: Optional[str], memory_gib: Optional[float] = None) -> Device:
    if name is None:
        name = "h100-80g"
    key = name.lower()
    if key not in DEVICES:
        raise PlanError(f"unknown GPU {name!r}; choose one of {sorted(set(DEVICES))} (or give --gpu-memory-gib with any of them)")
    device = DEVICES[key]
    if key == "cpu":
        device = replace(device, memory_gib=_cpu_memory_gib())
    if memory_gib is not None:
        if memory_gib <= 0:
            raise PlanError(f"--gpu-memory-gib must be positive, got {memory_gib}")
        device = replace(device, memory_gib=memory_gib)
    return device


# ---------------------------------------------------------------------------- options
ZERO_CHOICES = ("none", "zero3", "zero3-opt-offload", "zero3-offload")
ZERO_TEXT = {"none": "DDP (no ZeRO)", "zero3": "ZeRO-3", "zero3-opt-offload": "ZeRO-3 + optimizer offload",
             "zero3-offload": "ZeRO-3 + optimizer & param offload", "noopt": "no optimizer (one fwd+bwd)"}
SP_MODES = ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")


@dataclass(frozen=True)
class Options:
    mode: str
    sp: int
    ring_degree: int
    checkpointing: bool = False
    offload_checkpoints: bool = False
    tiled_mlp: int = 0            # tokens per MLP tile (0: off)
    loss_chunk: int = 0           # tokens per loss chunk (0: the whole local sequence at once)
    zero: str = "none"

    @property
    def ulysses_degree(self) -> int:
        return self.sp // self.ring_degree


def _topology_and_layout(mode: str, sp: int, ring: int):
    """The mode's own topology and layout for one SP group of `sp` ranks (raises ValueError
    where the mode refuses the split): the planner asks the code that runs, not a copy of
    its rules."""
    from easy_context.modes import get_mode

    spec = get_mode(mode)
    topology = spec.topology(sp, sp, ring)
    return topology, spec.layout(topology)


def layout_multiple(mode: str, sp: int, ring: int) -> int:
    """What the sequence length must divide by (the mode's layout.multiple)."""
    return _topology_and_layout(mode, sp, ring)[1].multiple


def check_layout(model: ModelShape, seq: int, mode: str, sp: int, ring: int) -> Optional[str]:
    """None when the mode runs this layout, else why not: the mode's own topology and length
    checks, and the head split models.check_config makes before the first forward."""
    try:
        topology, layout = _topology_and_layout(mode, sp, ring)
        layout.check_length(seq)
    except ValueError as error:
        return str(error)
    if model.heads % topology.ulysses_degree:
        return f"num_attention_heads={model.heads} does not split over ulysses_degree={topology.ulysses_degree}"
    return None


def layouts(model: ModelShape, seq: int, gpus: int, sp_sizes=None, modes=None):
    """(mode, sp, ring) that run on `gpus` ranks, and the ones refused with the reason."""
    ok, refused = [], []
    for sp in [d for d in range(1, gpus + 1) if gpus % d == 0]:
        if sp_sizes and sp not in sp_sizes:
            continue
        cands = [("data_parallel", 1, 1)] if sp == 1 else (
            [("zigzag_ring_attn", sp, sp), ("dist_flash_attn", sp, sp), ("ulysses_attn", sp, 1)]
            + [("usp_attn", sp, r) for r in range(2, sp) if sp % r == 0])
        for mode, s, r in cands:
            if modes and mode not in modes:
                continue
            why = check_layout(model, seq, mode, s, r)
            (refused if why else ok).append((mode, s, r, why) if why else (mode, s, r))
    return ok, refused


def default_tile(model: ModelShape) -> int:
    """MLP tile: about hidden_size tokens (ALST's choice), at least 1024."""
    return max(1024, 1 << (model.hidden - 1).bit_length())


def default_chunk(model: ModelShape) -> int:
    """Loss chunk: the largest power of two whose fp32 logits and their gradients (12 B per
    token per vocabulary entry) stay within 2 GiB, 1024..8192 tokens."""
    c = 2 * GIB // (12 * model.vocab)
    return int(min(8192, max(1024, 1 << (max(1, c).bit_length() - 1))))


# ---------------------------------------------------------------------- memory model
def activation_terms(model: ModelShape, o: Options, a: int) -> dict:
    """Bytes per local token (and per layer where named so) that autograd keeps, derived from
    what each op saves for backward and checked against torch's saved-tensor hooks on a
    Llama decoder layer (fp32 and bf16, three shapes: docs/planner.md)."""
    h, q, kv, i = model.hidden, model.q, model.kv, model.active_intermediate
    u = o.ulysses_degree if o.mode in ("ulysses_attn", "usp_attn") else 1
    rep = math.lcm(model.kv_heads, u) // model.kv_heads if u > 1 else 1
    kv_saved = kv * rep
    norm = 4 * h + 2 * a * h + 4               # RMSNorm: fp32 input, normalized, output (+ rsqrt)
    attn = norm + a * (q + 2 * kv_saved) + a * q + 4 * model.heads   # q,k,v after RoPE; output; fp32 lse
    if u > 1:
        attn += a * q                          # Ulysses: the inner attention's output, before the all-to-all back
    mlp_in = norm
    mlp = 4 * a * i                            # gate, act(gate), up, act*up
    return {"u": u, "rep": rep, "kv_saved": kv_saved, "attn": attn, "mlp_in": mlp_in, "mlp": mlp}


def attention_transient(model: ModelShape, o: Options, a: int, kv_saved: int) -> int:
    """Bytes per local token live during one layer's attention backward (its largest phase)."""
    q = model.q
    kernel = 4 * q + a * (q + 2 * kv_saved)        # fp32 dq accumulation + dq, dk, dv
    if o.mode == "data_parallel" or o.sp == 1:
        return kernel
    if o.mode == "dist_flash_attn":                # prefetched q/k/v, partial dK/dV (fp32) going back
        return kernel + 2 * a * (q + 2 * kv_saved) + 4 * 2 * kv_saved
    ring = 0
    if o.ring_degree > 1:                          # K/V double buffer, dK/dV fp32 local + in flight
        ring = 2 * a * 2 * kv_saved + 2 * 4 * 2 * kv_saved
    a2a = 2 * a * (q + 2 * kv_saved) if o.ulysses_degree > 1 else 0   # send + receive buffers
    return kernel + ring + a2a


def loss_bytes_per_token(model: ModelShape, a: int) -> int:
    """One chunk: fp32 log-softmax output, its gradient and the NLL gradient (+ the bf16 logits
    or their gradient when the activations are not fp32)."""
    return model.vocab * (12 + (a if a < 4 else 0))


def estimate(model: ModelShape, seq: int, gpus: int, o: Options, device: Device, dtype: str = "bf16",
             persistent_grads: bool = True) -> dict:
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
        gather = 0 if (W == 1 and o.zero != "zero3-offload") else 1    # a full copy needs no gathering
        buckets = 1 if (gather or o.zero != "zero3") else 0              # gradients leave through buckets
        if o.zero == "zero3":
            states["params (bf16 shard)"] = 2 * N / W
            states["gradients (bf16 shard)"] = 2 * N / W
            states["optimizer (fp32 master, m, v shard)"] = 12 * N / W
        elif o.zero == "zero3-opt-offload":
            states["params (bf16 shard)"] = 2 * N / W
        # gathered parameters and gradient buckets in flight (stage-3 prefetch + reduce)
        gathered_layers = gather * 2 * (2 * layer_p) + buckets * 2 * (2 * layer_p)   # 2 layers, bf16
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
    remat = L * (a * model.q + 4 * model.heads) if (o.checkpointing and o.mode == "dist_flash_attn") else 0
    loss_tok = loss_bytes_per_token(model, a)

    phases = {}
    # F: the loss, at the start of the backward: every layer's saved tensors, the final norm's,
    # one chunk of logits with its gradients, the output layer's gradient (or gathered weight).
    phases["loss"] = {
        "runtime": device.runtime_gib * GIB, **states,
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
        recompute = act["attn"] + act["mlp_in"] + (0 if tiled else act["mlp"]) + (hb * h if o.offload_checkpoints else 0)
    i = model.active_intermediate
    mlp_tmp = 6 * a * i * min(o.tiled_mlp, s) if tiled else 2 * a * i * s   # tile: recomputed + grads; whole: grads
    common = {
        "runtime": device.runtime_gib * GIB, **states,
        "gathered params / grad buckets": gathered_layers,
        "output-layer + layer gradients": grad_lm + grad_layer,
        "saved activations (all layers)": saved_layers * s,
        "attention outputs kept for the recompute (dist_flash)": remat * s,
        "recomputed layer": recompute * s,
        "hidden grads + RoPE + ids": (2 * hidden_grad + rope + ids) * s,
    }
    phases["layer backward: MLP"] = {**common, "MLP transient (tile or whole)": mlp_tmp}
    attn_part = dict(common)
    attn_part["recomputed layer"] = (recompute - (act["mlp_in"] + (0 if tiled else act["mlp"]))) * s if o.checkpointing else recompute * s
    if not o.checkpointing:   # the MLP's saved tensors of the last layer are freed by now
        attn_part["saved activations (all layers)"] -= (act["mlp_in"] + (0 if tiled else act["mlp"])) * s
    attn_part["attention transient (mode)"] = attn_t * s
    phases["layer backward: attention"] = attn_part
    if not persistent_grads or o.zero == "noopt":
        phases["end of backward"] = {"runtime": device.runtime_gib * GIB, **states, "all gradients": 4 * N,
                                     "hidden grads + RoPE + ids": (2 * hidden_grad + rope + ids) * s}
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=totals.get)
    return {"peak_bytes": totals[peak_phase], "peak_phase": peak_phase,
            "terms": {k: v for k, v in phases[peak_phase].items() if v},
            "phases": totals, "local_tokens": s, "loss_chunk": chunk, "tiled": tiled, "persistent": persistent}


# -------------------------------------------------------------------------- roofline
EFFICIENCY = 0.5   # achieved fraction of the device's peak on the FLOPs actually executed


def throughput(model: ModelShape, seq: int, gpus: int, o: Options, device: Device, dtype: str = "bf16") -> dict:
    """Seconds per step (one sequence of `seq` tokens per SP group) and tokens/s of the job."""
    a = 4 if dtype == "fp32" else 2
    s = seq // o.sp
    L, h, q = model.layers, model.hidden, model.q
    P = model.matmul_params_per_token
    attn_fwd = 2 * seq * q * L                       # causal QK^T + PV per token, all layers
    flops = 6 * P + 3.5 * attn_fwd                   # fwd + bwd (flash backward recomputes the scores)
    if o.checkpointing:
        flops += 2 * (P - model.vocab * h)           # layers' forward again
        if o.mode != "dist_flash_attn":
            flops += attn_fwd                        # attention forward again (dist_flash keeps its output)
    if 0 < o.tiled_mlp < s:
        flops += 2 * 3 * h * model.active_intermediate * L   # each tile's MLP forward again
    if o.mode != "data_parallel" or o.loss_chunk:
        flops += 2 * model.vocab * h                 # output layer forward again (train.py checkpoints each loss chunk)
    t_compute = s * flops / (device.tflops * 1e12 * EFFICIENCY)

    def bw(group: int, stride: int = 1) -> float:    # a group of `group` ranks `stride` apart
        return (device.link_gbs if group * stride <= device.per_node else device.network_gbs) * 1e9

    u = o.ulysses_degree if o.mode in ("ulysses_attn", "usp_attn") else 1
    r = o.ring_degree if o.mode in ("zigzag_ring_attn", "usp_attn", "dist_flash_attn") else 1
    act = activation_terms(model, o, a)
    kv = act["kv_saved"]
    passes = 3 if o.checkpointing else 2             # forward, (recompute,) backward
    t_ring = t_a2a = 0.0
    if r > 1 and o.sp > 1:
        per_layer = s * 2 * kv * (a * (r - 1) * (passes - 1 if o.mode != "dist_flash_attn" else 1) + a * (r - 1) + 4 * r)
        if o.mode == "dist_flash_attn":
            per_layer *= 0.65                        # balanced schedule moves less (docs/benchmarks.md: 40 vs 64 MiB at P=2)
        t_ring = L * per_layer / bw(r, u)
    if u > 1:
        per_layer = s * a * (2 * q + 2 * kv) * (u - 1) / u * passes   # q, k, v, out (and their grads) each pass
        t_a2a = L * per_layer / bw(u)
    t_zero = t_offload = t_optim = 0.0
    N = model.params
    if o.zero in ("zero3", "zero3-opt-offload", "zero3-offload") and gpus > 1:
        t_zero = passes * 2 * N * (gpus - 1) / gpus / bw(gpus)
    if o.zero == "zero3-offload":
        t_zero = max(t_zero, passes * 2 * N / gpus / (device.pcie_gbs * 1e9))
    if o.zero in ("zero3-opt-offload", "zero3-offload"):
        t_optim = N / gpus / device.optimizer_params_per_s + 2 * 2 * N / gpus / (device.pcie_gbs * 1e9)
    if o.checkpointing and o.offload_checkpoints:    # on the compute stream (transformers): not overlapped
        t_offload = 2 * L * a * h * s / (device.pcie_gbs * 1e9)
    bound = {"compute": t_compute, "ring P2P": t_ring, "ZeRO-3 gathers": t_zero}
    overlapped = max(bound.values())
    step = overlapped + t_a2a + t_offload + t_optim
    dp = gpus // o.sp
    limiter = max(bound, key=bound.get)
    if t_a2a + t_offload + t_optim > overlapped:
        limiter = max({"all-to-all": t_a2a, "checkpoint offload": t_offload, "CPU optimizer": t_optim}.items(),
                      key=lambda kv_: kv_[1])[0]
    return {"step_s": step, "tokens_per_s": seq * dp / step, "limiter": limiter, "flops_per_token": flops,
            "t_compute": t_compute, "t_ring": t_ring, "t_a2a": t_a2a, "t_zero": t_zero, "t_offload": t_offload,
            "t_optimizer": t_optim}


# ----------------------------------------------------------------------------- planner
def candidate_options(model: ModelShape, seq: int, layout, zero_choices, tile: int, chunk: int):
    mode, sp, ring = layout
    local = seq // sp  # a tile or chunk at least this long changes nothing: not a separate row
    for ckpt, off in ((False, False), (True, False), (True, True)):
        for t in (0, tile) if tile < local else (0,):
            for c in (0, chunk) if chunk < local else (0,):
                for z in zero_choices:
                    yield Options(mode, sp, ring, ckpt, off, t, c, z)


def row_of(model, seq, gpus, o: Options, device, dtype, margin, persistent_grads=True) -> dict:
    mem = estimate(model, seq, gpus, o, device, dtype, persistent_grads)
    tp = throughput(model, seq, gpus, o, device, dtype)
    budget = device.memory_gib * GIB * (1 - margin)
    return {
        "mode": o.mode, "sp_size": o.sp, "ring_degree": o.ring_degree, "ulysses_degree": o.ulysses_degree,
        "dp_size": gpus // o.sp, "activation_checkpointing": o.checkpointing, "offload_checkpoints": o.offload_checkpoints,
        "tiled_mlp": o.tiled_mlp, "loss_chunk_size": o.loss_chunk, "zero": o.zero,
        "peak_gib": round(mem["peak_bytes"] / GIB, 3), "fits": mem["peak_bytes"] <= budget,
        "tokens_per_s": round(tp["tokens_per_s"], 1), "step_s": round(tp["step_s"], 3), "limiter": tp["limiter"],
        "peak_phase": mem["peak_phase"], "terms_gib": {k: round(v / GIB, 3) for k, v in mem["terms"].items()},
    }


def flags_of(row: dict, seq: int) -> str:
    """train.py / accelerate flags for a row (`seq`: the sequence length planned for)."""
    parts = [f"--parallel_mode {row['mode']}"]
    if row["mode"] != "data_parallel" and row["dp_size"] > 1:
        parts.append(f"--sp-size {row['sp_size']}")
    if row["mode"] == "usp_attn":
        parts.append(f"--ring_degree {row['ring_degree']}")
    if row["activation_checkpointing"]:
        parts.append("--activation-checkpointing")
    if row["offload_checkpoints"]:
        parts.append("--offload-checkpoints")
    if row["tiled_mlp"]:
        parts.append(f"--tiled-mlp {row['tiled_mlp']}")
    # no chunking: one chunk as long as the rank's shard of the sequence
    parts.append(f"--seq-length {seq} --loss-chunk-size {row['loss_chunk_size'] or seq // row['sp_size']}")
    config = {"none": "no DeepSpeed (DDP)",
              "zero3": "ZeRO-3: accelerate_configs/zero3_offload.json without offload_optimizer and offload_param",
              "zero3-opt-offload": "ZeRO-3: accelerate_configs/zero3_offload.json without offload_param",
              "zero3-offload": "ZeRO-3: accelerate_configs/single_node.yaml (zero3_offload.json as shipped)",
              "noopt": "no optimizer"}[row["zero"]]
    return " ".join(parts) + f"   [{config}]"


def complexity(row: dict) -> int:
    """How many memory options a row turns on (ZeRO levels count one each)."""
    zero = ZERO_CHOICES.index(row["zero"]) if row["zero"] in ZERO_CHOICES else 0
    return (row["activation_checkpointing"] + row["offload_checkpoints"] + bool(row["tiled_mlp"])
            + bool(row["loss_chunk_size"]) + zero)


def plan(model: ModelShape, seq: int, gpus: int, device: Device, dtype: Optional[str] = None, margin: float = 0.10,
         sp_sizes=None, modes=None, zero_choices=None, tile: Optional[int] = None, chunk: Optional[int] = None) -> dict:
    if seq < 1:
        raise PlanError(f"--seq-length must be positive, got {seq}")
    if gpus < 1:
        raise PlanError(f"--gpus must be positive, got {gpus}")
    if not 0 <= margin < 1:
        raise PlanError(f"--margin must be in [0, 1), got {margin}")
    dtype = dtype or ("fp32" if device.name == "cpu" else "bf16")
    zero_choices = tuple(zero_choices or ZERO_CHOICES)
    tile = tile or default_tile(model)
    chunk = chunk or default_chunk(model)
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    wrong = [sp for sp in (sp_sizes or ()) if sp not in divisors]
    if wrong:
        raise PlanError(f"--sp-size {wrong[0]} does not divide --gpus {gpus}; choose from {divisors}")
    ok, refused = layouts(model, seq, gpus, sp_sizes, modes)
    if not ok:
        multiples = sorted({layout_multiple(m, s, r) for m, s, r, _ in refused})
        reasons = "; ".join(sorted({f"{m} sp={s}" + (f" ring={r}" if m == "usp_attn" else "") + f": {why}"
                                    for m, s, r, why in refused}))
        hint = f" Sequence lengths must divide by one of {multiples}." if multiples else ""
        raise PlanError(f"no mode runs {seq} tokens on {gpus} GPUs with these settings ({reasons}).{hint}")
    rows = [row_of(model, seq, gpus, o, device, dtype, margin)
            for layout in ok for o in candidate_options(model, seq, layout, zero_choices, tile, chunk)]
    rows.sort(key=lambda r: (not r["fits"], -r["tokens_per_s"] if r["fits"] else r["peak_gib"], complexity(r), r["peak_gib"]))
    best = None
    if rows[0]["fits"]:  # the fastest that fits; within 1% of it, the fewest options, then the least memory
        near = [r for r in rows if r["fits"] and r["tokens_per_s"] >= 0.99 * rows[0]["tokens_per_s"]]
        best = min(near, key=lambda r: (complexity(r), r["peak_gib"]))
        rows.remove(best)
        rows.insert(0, best)
    result = {"model": asdict(model), "params": model.params, "seq_length": seq, "gpus": gpus, "device": asdict(device),
              "dtype": dtype, "margin": margin, "tile": tile, "chunk": chunk, "recommendation": best, "rows": rows,
              "refused": [{"mode": m, "sp_size": s, "ring_degree": r, "why": w} for m, s, r, w in refused]}
    if best is None:
        result["smallest"] = smallest_fit(model, seq, gpus, device, dtype, margin, rows, sp_sizes, modes, zero_choices, tile, chunk)
    return result


def smallest_fit(model, seq, gpus, device, dtype, margin, rows, sp_sizes, modes, zero_choices, tile, chunk) -> dict:
    """The least memory per GPU that would fit at this GPU count, and the fewest GPUs (doubling
    --gpus, sequence parallelism over all of them) that fit at this memory."""
    need_gib = min(r["peak_gib"] for r in rows) / (1 - margin)
    more = None
    g = gpus
    while g < 1 << 16:
        g = g * 2
        ok, _ = layouts(model, seq, g, None, modes)
        fits = [row_of(model, seq, g, o, device, dtype, margin) for layout in ok if layout[1] == g
                for o in candidate_options(model, seq, layout, zero_choices, tile, chunk)]
        if any(r["fits"] for r in fits):
            more = g
            break
    return {"memory_gib": round(need_gib, 1), "gpus": more}


# --------------------------------------------------------------------------------- CLI
COLUMNS = ["#", "mode", "sp", "ring", "ckpt", "offload ckpt", "tiled MLP", "loss chunk", "ZeRO", "peak GiB/rank",
           "fits", "tokens/s", "bound by"]


def table_cells(rank: int, r: dict) -> list:
    return [str(rank), r["mode"], str(r["sp_size"]), str(r["ring_degree"]), "yes" if r["activation_checkpointing"] else "no",
            "yes" if r["offload_checkpoints"] else "no", str(r["tiled_mlp"] or "off"), str(r["loss_chunk_size"] or "whole"),
            r["zero"], f"{r['peak_gib']:.2f}", "yes" if r["fits"] else "NO", f"{r['tokens_per_s']:.0f}", r["limiter"]]


def render(result: dict, rows: list) -> str:
    m, dev = result["model"], result["device"]
    out = [f"model {m['name']}: {result['params'] / 1e9:.2f}B params, hidden {m['hidden']}, intermediate {m['intermediate']}, "
           f"{m['layers']} layers, {m['heads']} heads / {m['kv_heads']} KV heads, vocab {m['vocab']}",
           f"{result['seq_length']} tokens on {result['gpus']} x {dev['name']} ({dev['memory_gib']:.1f} GiB each), {result['dtype']}, "
           f"safety margin {result['margin']:.0%}", ""]
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("|" + "---|" * len(COLUMNS))
    for i, r in enumerate(rows, 1):
        out.append("| " + " | ".join(table_cells(i, r)) + " |")
    shown = len(rows)
    if shown < len(result["rows"]):
        out.append(f"\n({shown} of {len(result['rows'])} combinations shown; --all for every one)")
    best = result["recommendation"]
    if best:
        out.append(f"\nrecommended: {best['mode']}, sp_size {best['sp_size']}"
                   + (f", ring_degree {best['ring_degree']}" if best["mode"] == "usp_attn" else "")
                   + f": {best['peak_gib']:.2f} GiB/rank predicted, {best['tokens_per_s']:.0f} tokens/s predicted")
        out.append("  " + flags_of(best, result["seq_length"]))
        out.append(f"  memory at the peak ({best['peak_phase']}):")
        for k, v in best["terms_gib"].items():
            out.append(f"    {k}: {v:.2f} GiB")
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m easy_context.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}), a local config folder, or a cached hub name")
    p.add_argument("--seq-length", type=int, required=True, help="tokens per training sequence")
    p.add_argument("--gpus", type=int, default=8, help="devices in the job (world size)")
    p.add_argument("--gpu", default="h100-80g", help=f"one of {sorted(set(DEVICES))}")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="memory per device (overrides the named GPU's; cpu: this machine's memory / --gpus)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 (cpu: fp32)")
    p.add_argument("--margin", type=float, default=0.10, help="safety margin: a row fits when peak <= memory x (1 - margin)")
    p.add_argument("--sp-size", type=int, action="append", default=None, help="only these SP sizes (repeatable)")
    p.add_argument("--mode", action="append", default=None, help="only these modes (repeatable)")
    p.add_argument("--zero", action="append", default=None, choices=ZERO_CHOICES + ("noopt",), help="only these ZeRO settings")
    p.add_argument("--tiled-mlp", type=int, default=None, help="MLP tile to consider (default: ~hidden_size tokens, >= 1024)")
    p.add_argument("--loss-chunk-size", type=int, default=None, help="loss chunk to consider (default: logits within 2 GiB)")
    p.add_argument("--top", type=int, default=15, help="rows to print (best first)")
    p.add_argument("--all", action="store_true", help="print every combination")
    p.add_argument("--json", action="store_true", help="the same rows as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.mode:
            unknown = [m for m in args.mode if m not in SP_MODES + ("data_parallel",)]
            if unknown:
                raise PlanError(f"unknown mode(s) {unknown}; choose from {list(SP_MODES + ('data_parallel',))}")
        model = load_model(args.model)
        device = get_device(args.gpu, args.gpu_memory_gib)
        if device.name == "cpu" and args.gpu_memory_gib is None:   # the ranks share the machine's memory
            device = replace(device, memory_gib=device.memory_gib / max(1, args.gpus))
        for name in ("tiled_mlp", "loss_chunk_size", "top"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be positive, got {value}")
        result = plan(model, args.seq_length, args.gpus, device, args.dtype, args.margin, args.sp_size, args.mode,
                      args.zero, args.tiled_mlp, args.loss_chunk_size)
    except PlanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = result["rows"] if args.all else result["rows"][:args.top]
    if args.json:
        print(json.dumps({**result, "rows": rows, "rows_total": len(result["rows"])}, indent=1))
    else:
        print(render(result, rows))
    if result["recommendation"] is None:
        small = result["smallest"]
        more = f"{small['gpus']} x {args.gpu}" if small["gpus"] else "no GPU count up to 65536"
        print(f"error: nothing fits {args.seq_length} tokens on {args.gpus} x {device.name} ({device.memory_gib:.1f} GiB, "
              f"margin {args.margin:.0%}); the best combination needs {small['memory_gib']} GiB per GPU, "
              f"or use {more}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
