"""Each mixer family sequence parallel, over the kernels transformers gives it.

The kernels are passed in, with transformers' signatures (its torch paths take an initial state
and return the final one; on CUDA the same entry points reach causal_conv1d, mamba_ssm or
flash-linear-attention where installed), so the arithmetic of each family stays transformers'
own and what is here is only how runs and heads are put together:

- causal_conv: a depthwise causal convolution over (B, C, S); each run gets its halo.
- mamba2_scan: Mamba-2's SSD scan (state (B, H, P, N), a scalar decay per head per token).
- gated_delta_rule: the gated delta rule (state (B, H, dk, dv); each token's transition is a
  dk x dk matrix, exp(g) (I - beta k k^T)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from easy_context.core.collectives import all_gather_with_grad
from easy_context.core.exchange import heads_to_seq, seq_to_heads
from easy_context.mixers import state_passing as passing

__all__ = ["causal_conv", "mamba2_scan", "gated_delta_rule"]


# ---------------------------------------------------------------- convolution
def causal_conv(conv, x: torch.Tensor, weight: torch.Tensor, sharding, keep: int | None = None, **kwargs):
    """conv(x, weight, ...) on (B, C, S_local) as on the whole sequence: each run is convolved
    after the last kernel - 1 inputs of the run before it (zeros before the first). With `keep`
    (a position), also the kernel's inputs that end there (B, C, kernel), on every rank: the
    convolution state a cache holds after it."""
    width = weight.shape[-1] - 1
    runs = passing.split(x, sharding, dim=-1)
    short = [run.shape[-1] for _, run in runs if run.shape[-1] < width]
    if short:
        raise ValueError(
            f"a run of {short[0]} tokens is shorter than the convolution's halo of {width}: use a longer sequence "
            "or fewer ranks"
        )
    halos = passing.halos([run[..., -width:] for _, run in runs], sharding) if width else [x[..., :0]] * len(runs)
    starts = passing.run_starts(sharding)
    if width == 0:
        out = conv(x, weight, **kwargs)
    elif sharding.starts is not None:
        outs = [
            _conv_documents(conv, halo, run, start, weight, sharding, kwargs)
            for halo, (_, run), start in zip(halos, runs, starts)
        ]
        out = passing.join(outs, dim=-1)
    else:
        outs = [
            conv(torch.cat([halo, run], dim=-1), weight, **kwargs)[..., width:] for halo, (_, run) in zip(halos, runs)
        ]
        out = passing.join(outs, dim=-1)
    if keep is None:
        return out
    _, local = passing.holder(sharding, keep)
    mine = None
    if local is not None:  # positions keep - width .. keep of [halo, run]
        offset = keep - starts[local]
        mine = torch.cat([halos[local], runs[local][1]], dim=-1)[..., offset : offset + width + 1]
    return out, passing.from_holder(mine, x.new_empty(*x.shape[:2], width + 1), sharding, keep)


def _conv_documents(conv, halo, run, start, weight, sharding, kwargs) -> torch.Tensor:
    """One run of packed rows, row by row and document by document: each stretch is convolved
    after the inputs before it that are in its own document (zeros in place of the others, as a
    document convolved alone is padded)."""
    width = halo.shape[-1]
    rows = []
    for row in range(run.shape[0]):
        extended = torch.cat([halo[row : row + 1], run[row : row + 1]], dim=-1)  # from position start - width
        outs = []
        for lo, hi, begins in passing.stretches(sharding, row, start, run.shape[-1]):
            first = start + lo if begins else passing.document_start(sharding, row, start)
            window = extended[..., lo : width + hi]  # positions start + lo - width .. start + hi - 1
            positions = torch.arange(start + lo - width, start + hi, device=window.device)
            # a product, not a slice: the gathered halo stays in every rank's result (its backward is a collective)
            window = window * (positions >= first).to(window.dtype)
            outs.append(conv(window, weight, **kwargs)[..., width:])
        rows.append(torch.cat(outs, dim=-1))
    return torch.cat(rows, dim=0)


# -------------------------------------------------------------------- Mamba-2
def _mamba2_decay(dt, A, dt_bias, dt_limit) -> torch.Tensor:
    """(B, H): the factor a run multiplies the state it starts from by, exp(sum_t A dt_t), with
    dt discretized as the SSD scan does it (bias, softplus, clamp)."""
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_limit[0], max=dt_limit[1])
    return torch.exp((A.float() * dt).sum(dim=1))


def mamba2_scan(scan, x, dt, A, B, C, sharding, strategy, *, chunk_size, D, dt_bias, dt_limit, keep=None, **kwargs):
    """scan(x (B, S, H, P), dt (B, S, H), A (H,), B/C (B, S, G, N), ...) -> y (B, S, H, P) on
    this rank's tokens, as on the whole sequence (transformers' mamba2_chunk_scan signature).
    With `keep` (a position; state passing only), (y, the state after that position on every
    rank)."""
    options = dict(chunk_size=chunk_size, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit, **kwargs)
    if strategy == "head_exchange":
        return _mamba2_head_exchange(scan, x, dt, A, B, C, D, sharding, options)
    runs = _runs(sharding, x, dt, B, C)  # [(x, dt, B, C) of each run]

    def final(xr, dtr, Br, Cr, initial=None):
        return scan(xr, dtr, A, Br, Cr, initial_states=initial, return_final_states=True, **options)[1]

    def output(xr, dtr, Br, Cr, initial):
        return scan(xr, dtr, A, Br, Cr, D=D, initial_states=initial, **options)

    finals = [final(*run) for run in runs]
    decays = [_mamba2_decay(dtr, A, dt_bias, dt_limit) for _, dtr, _, _ in runs]
    return _pass_states(runs, finals, decays, sharding, final, output, lambda d, h: d[..., None, None] * h, keep)


def _pass_states(runs, finals, transitions, sharding, final, output, apply, keep):
    """State passing from the runs' summaries: this rank's output (B, S_local, ...) and, with
    `keep`, the state after that position on every rank."""
    if sharding.starts is None:
        carried = passing.carried(finals, transitions, sharding, apply)
        out = passing.join([output(*run, state) for run, state in zip(runs, carried)], dim=1)
    else:
        carried, out = _scan_documents(runs, finals, transitions, sharding, final, output, apply)
    if keep is None:
        return out
    return out, _state_at(keep, runs, carried, sharding, final, finals[0])


def _state_at(position, runs, carried, sharding, final, like):
    """The state after `position`: its run, from the state carried into it (or from its
    document's start), on the rank that holds it; broadcast to the others."""
    _, local = passing.holder(sharding, position)
    mine = None
    if local is not None:
        run, state, start = runs[local], carried[local], passing.run_starts(sharding)[local]
        end = position - start + 1
        rows = []
        for row in range(run[0].shape[0]):
            lo, begins = 0, False
            if sharding.starts is not None:
                lo, _, begins = passing.stretches(sharding, row, start, end)[-1]
            initial = None if lo > 0 or begins else state[row : row + 1]
            rows.append(final(*(x[row : row + 1, lo:end] for x in run), initial))
        mine = torch.cat(rows)
    return passing.from_holder(mine, like, sharding, position)


def _scan_documents(runs, finals, transitions, sharding, final, output, apply):
    """State passing over packed rows: (the states carried into this rank's runs, its output).
    A run's summary, row by row, is its own (no document starts in it) or that of its last
    document from a zero start, with a zero transition (the state restarts); each document of a
    run then scans from the state carried in (its first, if it continues one from an earlier
    run) or from zeros. Rows and documents one kernel call each."""
    starts = passing.run_starts(sharding)
    cuts = [
        [passing.stretches(sharding, row, start, run[0].shape[1]) for row in range(run[0].shape[0])]
        for run, start in zip(runs, starts)
    ]
    summaries = ([], [])
    for run, run_cuts, f, t in zip(runs, cuts, finals, transitions):
        rows_f, rows_t = [], []
        for row, stretches in enumerate(run_cuts):
            restarted = any(begins for _, _, begins in stretches)
            lo = stretches[-1][0]
            rows_f.append(final(*(x[row : row + 1, lo:] for x in run)) if restarted else f[row : row + 1])
            rows_t.append(t[row : row + 1] * (0 if restarted else 1))
        summaries[0].append(torch.cat(rows_f))
        summaries[1].append(torch.cat(rows_t))
    carried = passing.carried(*summaries, sharding, apply)
    outs = []
    for run, run_cuts, state in zip(runs, cuts, carried):
        rows = []
        for row, stretches in enumerate(run_cuts):
            parts = []
            for lo, hi, begins in stretches:
                # zeros made from the carried state where a document begins: the gather's backward
                # is a collective every rank must join
                initial = state[row : row + 1] * (0 if begins else 1) if lo == 0 else None
                parts.append(output(*(x[row : row + 1, lo:hi] for x in run), initial))
            rows.append(torch.cat(parts, dim=1))
        outs.append(torch.cat(rows))
    return carried, passing.join(outs, dim=1)


def _runs(sharding, *tensors) -> list[tuple]:
    """Per run of this rank (local order): the run's slice of each (B, S_local, ...) tensor."""
    return [tuple(parts) for parts in zip(*([t for _, t in passing.split(x, sharding, dim=1)] for x in tensors))]


def _mamba2_head_exchange(scan, x, dt, A, B, C, D, sharding, options):
    size, group, heads, r = sharding.size, sharding.group, x.shape[2], sharding.rank
    mine = slice(r * heads // size, (r + 1) * heads // size)  # the heads (and their groups) rank r runs
    x, dt = (_to_heads(t, sharding) for t in (x, dt.unsqueeze(-1)))
    # B and C: each rank's groups, or the one group every head reads, whole
    B, C = (_to_heads(t, sharding) if t.shape[2] > 1 else _whole(t, sharding) for t in (B, C))
    options = {**options, "dt_bias": options["dt_bias"][mine]}
    D = None if D is None else D[mine]
    y = _by_document(lambda x, dt, B, C: scan(x, dt.squeeze(-1), A[mine], B, C, D=D, **options), sharding, x, dt, B, C)
    return _to_seq(y, sharding, group)


def _by_document(scan, sharding, *whole):
    """scan(*whole) over whole sequences (B, S, ...), or, for packed rows, one call per row and
    document (each from a zero state)."""
    if sharding.starts is None:
        return scan(*whole)
    rows = []
    for row in range(whole[0].shape[0]):
        stretches = passing.stretches(sharding, row, 0, sharding.seq_len)
        rows.append(torch.cat([scan(*(t[row : row + 1, lo:hi] for t in whole)) for lo, hi, _ in stretches], dim=1))
    return torch.cat(rows)


def _order(sharding, device) -> torch.Tensor:
    """The global positions of the tokens after an all-to-all over the SP group: rank 0's
    tokens, then rank 1's, ... (the layout's local orders one after the other)."""
    return torch.cat([sharding.layout.local_indices(sharding.seq_len, r) for r in range(sharding.size)]).to(device)


def _to_heads(t: torch.Tensor, sharding) -> torch.Tensor:
    """(B, S_local, H, d) -> (B, S, H / P, d) in sequence order, differentiable."""
    by_rank = seq_to_heads(t.transpose(1, 2), sharding.group).transpose(1, 2)
    return by_rank.index_select(1, torch.argsort(_order(sharding, t.device)))


def _whole(t: torch.Tensor, sharding) -> torch.Tensor:
    """(B, S_local, ...) -> (B, S, ...) in sequence order on every rank, differentiable."""
    by_rank = all_gather_with_grad(t, sharding.group).movedim(0, 1).flatten(1, 2)
    return by_rank.index_select(1, torch.argsort(_order(sharding, t.device)))


def _to_seq(t: torch.Tensor, sharding, group) -> torch.Tensor:
    """(B, S, H / P, d) in sequence order -> (B, S_local, H, d)."""
    by_rank = t.index_select(1, _order(sharding, t.device))
    return heads_to_seq(by_rank.transpose(1, 2).contiguous(), group).transpose(1, 2)


# ---------------------------------------------------------------- gated delta rule
def gated_delta_rule(rule, q, k, v, g, beta, sharding, strategy, keep=None, **kwargs):
    """rule(q, k (B, S, H, dk), v (B, S, H, dv), g, beta (B, S, H), ...) -> (out, state) on this
    rank's tokens as on the whole sequence (transformers' torch_chunk_gated_delta_rule
    signature): the state is None, or with `keep` (a position; state passing only) the state
    after that position, on every rank."""
    if strategy == "head_exchange":
        q, k, v, g, beta = (_to_heads(t, sharding) for t in (q, k, v, g.unsqueeze(-1), beta.unsqueeze(-1)))
        out = _by_document(
            lambda q, k, v, g, beta: rule(q, k, v, g=g.squeeze(-1), beta=beta.squeeze(-1), **kwargs)[0],
            sharding,
            *(q, k, v, g, beta),
        )
        return _to_seq(out, sharding, sharding.group), None
    runs = _runs(sharding, q, k, v, g, beta)

    def final(qr, kr, vr, gr, br, initial=None):
        return rule(qr, kr, vr, g=gr, beta=br, initial_state=initial, output_final_state=True, **kwargs)[1]

    def output(qr, kr, vr, gr, br, initial):
        return rule(qr, kr, vr, g=gr, beta=br, initial_state=initial, output_final_state=False, **kwargs)[0]

    finals, transitions = [], []
    for qr, kr, vr, gr, br in runs:
        finals.append(final(qr, kr, vr, gr, br))
        # the transition: the final state from an identity start when no value is written
        dk = kr.shape[-1]
        eye = torch.eye(dk, dtype=finals[-1].dtype, device=kr.device).expand(*finals[-1].shape[:2], dk, dk)
        zero_values = torch.zeros(*vr.shape[:-1], dk, dtype=vr.dtype, device=vr.device)
        transitions.append(final(qr, kr, zero_values, gr, br, eye))
    result = _pass_states(runs, finals, transitions, sharding, final, output, lambda t, state: t @ state, keep)
    return result if keep is not None else (result, None)
