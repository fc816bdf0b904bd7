"""Other projects' sequence-parallel attention ("peers"), called the way their HF / module
integrations call it, for benchmarks/bench_attention.py.

Each adapter is `make(torch, F, dist, rank, world, spec, scale) -> (attend, shard, to_out)`:
  attend(q, k, v)  the peer's attention on this rank's shards, q/k/v (B, H, S_local, D) leaf
                   tensors (so their grads compare with SDPA's, sharded the same way)
  shard(x)         this rank's part of a global (B, H, S, D) tensor, in the peer's own layout
  to_out(x)        a sharded (B, H, S_local, D) tensor in the layout attend returns (the
                   upstream gradient, and the reference output for the check); None = as is

Peers (rows; each runs wherever its package is installed, else its rows say so):
  ringmaster_*     axolotl-ringmaster (import ringmaster): the attention functions its
                   ringmaster.setup() registers with transformers (strategies/ring.py,
                   ulysses.py, usp.py make_*_attention), built with inner_attn="sdpa" (what a CPU
                   model uses), on a CPRuntime from ringmaster.mesh.build_runtime(cpu mesh), called
                   as HF calls a registered attention: fn(module, q, k, v, None, scaling=...,
                   is_causal=True) -> (B, S_local, H, D). Variants (RingmasterConfig):
      p2p            backend=ring, rotate_method=alltoall (its p2p ring), load_balance=none
      allgather      backend=ring, rotate_method=allgather (its default), load_balance=none
      zigzag         backend=ring, load_balance=head_tail (zigzag shards [r, 2P-1-r])
      zigzag_varlen  the same with the runtime's packed-sequence metadata set to one document per
                     row (cu_seqlens [0, S]): its doc-masked zigzag blocks, exactly causal here
      distflash      backend=ring, load_balance=distflash
      ulysses        backend=ulysses around transformers' sdpa_attention_forward
      usp            ulysses_size=2 x ring_size=P/2, rotate_method=alltoall (P=2: ring_size 1,
                     which ringmaster resolves to its Ulysses backend)
  lucidrains_*     ring-attention-pytorch (import ring_attention_pytorch): ring_flash_attn(q, k, v,
                   causal=True, bucket_size=min(512, S_local), ring_reduce_col=True,
                   striped_ring_attn=..., ring_size=P) on (B, S_local, H, D) views, as its
                   RingAttention module calls it (bucket 512 is the module's default)
      ring           contiguous shards
      striped        its striped layout: the module's '(i j) -> (j i)' permutation with
                     i = bucket, then contiguous shards
  deepspeed_ulysses  (kept in bench_attention's own rows) DeepSpeed's UlyssesSPAttentionHF

Nothing here imports torch at module level: bench_attention's driver stays torch-free.
"""

from __future__ import annotations

import importlib.util
import os

GiB = 1024**3
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}

RINGMASTER_VARIANTS = ("p2p", "allgather", "zigzag", "zigzag_varlen", "distflash", "ulysses", "usp")
LUCIDRAINS_VARIANTS = ("ring", "striped")
PACKAGES = {
    "ringmaster": ("ringmaster", "axolotl-ringmaster==0.2.7"),
    "lucidrains": ("ring_attention_pytorch", "ring-attention-pytorch==0.5.20"),
}
PEERS = [f"ringmaster_{v}" for v in RINGMASTER_VARIANTS] + [f"lucidrains_{v}" for v in LUCIDRAINS_VARIANTS]
INSTALL_HINT = "pip install -e '.[peers]'"


def is_peer(config: str) -> bool:
    return config in PEERS


def always_checked(config: str) -> bool:
    """Rows whose errors against SDPA are always measured and never fail the run."""
    return config in PEERS or config == "deepspeed_ulysses"


def not_installed(config: str):
    """Why a peer cannot run at all here (its package is missing), or None."""
    module, requirement = PACKAGES[config.split("_", 1)[0]]
    if importlib.util.find_spec(module) is None:
        return f"not installed: {requirement} ({INSTALL_HINT})"
    return None


def select(text: str):
    """--peers: 'all' (every peer; a missing package gives rows that say so), 'none', or a
    comma list of peer names or package prefixes (ringmaster, lucidrains)."""
    if text in ("all", ""):
        return list(PEERS)
    if text == "none":
        return []
    chosen = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        names = [p for p in PEERS if p == item or p.startswith(item + "_")]
        if not names:
            raise ValueError(
                f"unknown peer {item!r}; choose from {', '.join(PEERS)} (or ringmaster, lucidrains, all, none)"
            )
        chosen += [n for n in names if n not in chosen]
    return chosen


def _usp_degrees(world):
    """(ulysses_size, ring_size) of the ringmaster_usp rows."""
    return (2, world // 2) if world % 2 == 0 else (world, 1)


def score_bytes_per_rank(config, S, P, B, Hq, Hkv, D):
    """Estimated peak bytes per rank of a ringmaster variant whose CPU fallback materialises
    fp32 (queries x keys) score blocks (explicit softmax), or None when it does not: 84 MiB +
    6.5 blocks (usp: 7.5), fitted to its peak MiB/rank at S=4096, P=2 and 4 (scores,
    probabilities, dP, dS and masks live at once in the backward; docs/benchmarks.md)."""
    variant = config.split("_", 1)[1] if config.startswith("ringmaster_") else None
    S_l = S // P
    if variant in ("p2p", "distflash", "zigzag_varlen"):
        heads, rows = Hq, S_l
    elif variant == "usp":
        u, r = _usp_degrees(P)
        if r == 1:  # Ulysses only: torch SDPA, no score blocks
            return None
        heads, rows = Hq // u, S // r
    else:
        return None
    return 84 * 2**20 + (7.5 if variant == "usp" else 6.5) * B * heads * rows * rows * 4


def memory_skip(config, S, P, B, Hq, Hkv, D, max_gib_per_rank, max_gib_total):
    """'skipped: ...' when a peer's estimated memory is over the limits, else None."""
    need = score_bytes_per_rank(config, S, P, B, Hq, Hkv, D)
    if need is None:
        return None
    if need > max_gib_per_rank * GiB:
        return f"skipped: needs ~{need / GiB:.1f} GiB/rank (S_local^2 fp32 scores; limit {max_gib_per_rank:g})"
    if need * P > max_gib_total * GiB:
        return (
            f"skipped: needs ~{need / GiB:.1f} GiB/rank x {P} ranks = {need * P / GiB:.1f} GiB "
            f"(S_local^2 fp32 scores; limit {max_gib_total:g} GiB in all)"
        )
    return None


# -------------------------------------------------------------------------------- adapters
def make(config, torch, F, dist, rank, world, spec, scale):
    """(attend, shard, to_out) of a peer or of deepspeed_ulysses, on this rank."""
    if config == "deepspeed_ulysses":
        return deepspeed_ulysses(torch, F, dist, rank, world, spec, scale)
    family, variant = config.split("_", 1)
    reason = not_installed(config)
    if reason:
        raise RuntimeError(reason)
    return {"ringmaster": ringmaster, "lucidrains": lucidrains}[family](variant, torch, dist, rank, world, spec, scale)


def _contiguous(rank, world):
    def shard(x):
        return x.chunk(world, dim=2)[rank]

    return shard


def _to_bshd(x):
    return x.transpose(1, 2).contiguous()


def ringmaster(variant, torch, dist, rank, world, spec, scale):
    import logging

    from ringmaster.config import Backend, LoadBalance, RingmasterConfig, RotateMethod
    from ringmaster.mesh import build_runtime
    from ringmaster.runtime import set_runtime
    from ringmaster.strategies.ring import _PROVIDER, make_ring_attention, resolve_ring_impl
    from ringmaster.strategies.ulysses import make_ulysses_attention
    from ringmaster.strategies.usp import make_usp_attention

    logging.getLogger("ringmaster").setLevel(logging.ERROR)  # "flash ops unavailable" on every CPU call
    S, B, Hq, Hkv = spec["S"], spec["B"], spec["Hq"], spec["Hkv"]
    inner = "sdpa"  # a CPU model's attn_implementation; ringmaster wraps / resolves it
    options = dict(size=world, backend=Backend.RING, rotate_method=RotateMethod.ALLTOALL)
    if variant == "allgather":
        options["rotate_method"] = RotateMethod.ALLGATHER
    elif variant in ("zigzag", "zigzag_varlen"):
        options["load_balance"] = LoadBalance.HEAD_TAIL
    elif variant == "distflash":
        options["load_balance"] = LoadBalance.DISTFLASH
    elif variant == "ulysses":
        options["backend"] = Backend.ULYSSES
        del options["rotate_method"]
    elif variant == "usp":
        u, r = _usp_degrees(world)
        options.update(backend=Backend.USP, ulysses_size=u, ring_size=r)
    config = RingmasterConfig(**options).normalize(num_kv_heads=Hkv, intra_node_size=world)
    runtime = build_runtime(config, device_type="cpu")
    set_runtime(runtime)
    # what ringmaster.setup() registers for the resolved backend (register_ulysses/_ring/_usp)
    resolved = resolve_ring_impl(config.ring_impl, inner)
    provider = _PROVIDER[resolved]
    blocks = inner if provider == "hf_kernels" else "flash_attention_2"
    if config.backend == Backend.ULYSSES:
        forward = make_ulysses_attention(inner)
    elif config.backend == Backend.RING:
        forward = make_ring_attention(provider, blocks, config.rotate_method)
    else:
        forward = make_usp_attention(provider, blocks, config.rotate_method)
    if variant == "zigzag_varlen":  # one document per batch row, as its CP context sets it
        runtime.varlen = (torch.arange(0, (B + 1) * S, S, dtype=torch.int32), S)

    class Attention(torch.nn.Module):  # stands in for the HF attention module
        is_causal = True
        num_key_value_groups = Hq // Hkv
        layer_idx = 0

    module = Attention()

    def attend(q, k, v):
        out, _ = forward(module, q, k, v, None, dropout=0.0, scaling=scale, is_causal=True)
        return out  # (B, S_local, H, D)

    if runtime.shard_load_balance == "head_tail":  # its _zigzag_shard: chunks [r, 2P-1-r] of 2P
        if S % (2 * world):
            raise ValueError(f"zigzag needs S divisible by 2P = {2 * world}")
        half = S // (2 * world)
        index = torch.cat(
            [
                torch.arange(rank * half, (rank + 1) * half),
                torch.arange((2 * world - 1 - rank) * half, (2 * world - rank) * half),
            ]
        )

        def shard(x):
            return x.index_select(2, index)
    else:
        shard = _contiguous(rank, world)
    return attend, shard, _to_bshd


def lucidrains(variant, torch, dist, rank, world, spec, scale):
    from ring_attention_pytorch import ring_flash_attn

    S, D = spec["S"], spec["D"]
    if abs(scale - D**-0.5) > 1e-12:
        raise ValueError("ring_flash_attn scales by head_dim ** -0.5 only")
    S_l = S // world
    bucket = min(512, S_l)  # RingAttention's default bucket_size, capped as ring_flash_attn caps it
    if S % world or S_l % bucket:
        raise ValueError(f"S/P = {S_l} must be a multiple of its bucket size {bucket}")
    striped = variant == "striped"

    def attend(q, k, v):
        out = ring_flash_attn(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, bucket, True, striped, None, world
        )
        return out  # (B, S_local, H, D)

    if striped:  # RingAttention (auto_shard_seq): 'b (i j) d -> b (j i) d', i = bucket; then contiguous
        p = torch.arange(S)
        index = (p % bucket) * (S // bucket) + p // bucket
        mine = index.chunk(world)[rank]

        def shard(x):
            return x.index_select(2, mine)
    else:
        shard = _contiguous(rank, world)
    return attend, shard, _to_bshd


def deepspeed_ulysses(torch, F, dist, rank, world, spec, scale):
    """DeepSpeed's UlyssesSPAttentionHF called directly on (q, k, v) shards, the way HF calls
    a registered attention: forward(module, q, k, v, attention_mask, position_ids=...).
    Its own sharding is contiguous; its output is (B, S_local, Hq*D)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    # deepspeed.comm wraps the torch process group that already exists (gloo).
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    S, B, Hq, Hkv, D = spec["S"], spec["B"], spec["Hq"], spec["Hkv"], spec["D"]
    group = dist.new_group(list(range(world)))

    def inner(module, q, k, v, attention_mask, *args, **kwargs):
        # the role of transformers' sdpa_attention_forward: returns (B, S, H, D), weights
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2), None

    ulysses = UlyssesSPAttentionHF(
        attn=inner,
        batch_size=B,
        attn_head_count=Hq,
        attn_head_size=D,
        kv_head_count=Hkv,
        num_hidden_layers=1,
        process_group=group,
        seq_length_is_variable=True,
    )

    class Layer(torch.nn.Module):  # stands in for the HF attention module
        is_causal = True
        num_key_value_groups = Hq // Hkv

    layer = Layer().train()
    S_l = S // world
    position_ids = torch.arange(rank * S_l, (rank + 1) * S_l).unsqueeze(0).expand(B, -1).contiguous()

    def attend(q, k, v):
        out, _ = ulysses(layer, q, k, v, None, position_ids=position_ids)
        return out

    def to_out(x):  # (B, H, S_local, D) -> (B, S_local, H*D)
        return x.transpose(1, 2).reshape(B, S_l, Hq * D).contiguous()

    return attend, _contiguous(rank, world), to_out


# ------------------------------------------------------------------------- check and table
def error_note(config, errors, dtype, Hq, Hkv):
    """The notes of a checked peer row: every error, and WRONG with the ones over tolerance."""
    tol = TOLERANCE[dtype]
    text = "err " + " ".join(f"{k} {v:.1e}" for k, v in errors.items())
    bad = [f"{k} err {v:.1e}" for k, v in errors.items() if not v < tol]
    if bad:
        text = "WRONG: " + ", ".join(bad) + "; " + text
        if config.startswith("lucidrains_") and Hq != Hkv:
            text += " (GQA: its query head i reads KV head i mod Hkv, HF's i // (Hq/Hkv))"
    return text


def summary(rows, dtype):
    """Peers against our modes per (S, P): time, peak, errors, and our best time / peak over
    each exact peer's ("" when no peer row ran)."""
    if not any(is_peer(r["config"]) for r in rows):
        return ""
    peers = [r for r in rows if always_checked(r["config"])]
    tol = TOLERANCE[dtype]
    ours = {}
    for r in rows:
        if (
            r["time_s"]
            and r["config"] != "baseline"
            and not (is_peer(r["config"]) or r["config"] == "deepspeed_ulysses")
        ):
            ours.setdefault((r["S"], r["P"]), []).append(r)
    header = [
        "peer",
        "S",
        "P",
        "time (s)",
        "peak MiB/rank (max)",
        "err out",
        "err dq",
        "err dk",
        "err dv",
        "exact",
        "our best time / its time",
        "our lowest peak / its peak",
        "notes",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in peers:
        errs = [r.get(f"err_{k}") for k in ("out", "dq", "dk", "dv")]
        ran = r["time_s"] is not None
        exact = ran and all(e is not None and e < tol for e in errs)
        mine = ours.get((r["S"], r["P"]), [])
        t_ratio = m_ratio = ""
        if exact and mine:
            fast = min(mine, key=lambda x: x["time_s"])
            measured = [x for x in mine if x["peak_mib_max"] is not None]  # merged CSVs can lack a peak
            low = min(measured, key=lambda x: x["peak_mib_max"]) if measured else None
            t_ratio = f"{fast['time_s'] / r['time_s']:.2f} ({fast['config']})"
            if low and r["peak_mib_max"] and r["peak_mib_max"] > 0:
                m_ratio = f"{low['peak_mib_max'] / r['peak_mib_max']:.2f} ({low['config']})"
        note = (
            r["notes"]
            if not ran
            else "; ".join(n for n in r["notes"].split("; ") if not n.startswith(("err ", "max err")))
        )
        if r["config"] == "ringmaster_usp" and _usp_degrees(r["P"])[1] == 1:
            note = "; ".join(filter(None, ["ring_size 1: its Ulysses backend", note]))
        lines.append(
            "| "
            + " | ".join(
                [
                    r["config"],
                    str(r["S"]),
                    str(r["P"]),
                    f"{r['time_s']:.3f}" if ran else "—",
                    f"{r['peak_mib_max']:.0f}" if ran else "—",
                    *[("" if e is None else f"{e:.1e}") for e in errs],
                    ("yes" if exact else "NO") if ran and errs[0] is not None else "—",
                    t_ratio,
                    m_ratio,
                    note,
                ]
            )
            + " |"
        )
    return "\n".join(lines)
