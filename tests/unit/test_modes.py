"""Modes declare what they support and what they cost; the recipes ask them.

The cost declarations (easy_context/modes/costs.py and each mode's MODE) give the figures of
the attention benchmark's analytic communication model, whose numbers docs/benchmarks.md shows
equal to the bytes counted on the wire; the planner, train.py and the eval scripts compare no
mode names."""

import ast
import itertools
import math
from pathlib import Path

from easy_context.modes import BUILT_MODES, MODE_NAMES, get_mode, modes_with
from easy_context.modes.costs import AttentionShape, Traffic, balanced_schedule_traffic
from easy_context.modes.dist_flash_attn import balanced_schedule

ROOT = Path(__file__).resolve().parents[2]
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


# An independent derivation of each mode's bytes (the algorithms written out once more, as the
# attention benchmark had them before it asked the modes), against the modes' declarations.
def reference_bytes(config, S, P, B, Hq, Hkv, D, dtype):
    """Bytes one rank sends per fwd+bwd, from the algorithm (None when not derived).

    ring (zigzag_ring_attn, and the ring part of usp_attn):
        forward   K and V shards rotate P-1 times                 2 (P-1) kv
        backward  K and V rotate P-1 times again                  2 (P-1) kv
                  dK/dV accumulators (fp32) go straight back      2 (P-1) kv_acc
                  to their owner, once per borrowed K/V block
        (causal, unmasked: every step is needed; masks skip steps and transfers)
    Ulysses (ulysses_attn, usp_attn's Ulysses part, deepspeed_ulysses):
        forward   all-to-all of q, k, v and the output            4 x (P-1)/P of each
        backward  all-to-all of dout, dq, dk, dv                  4 x (P-1)/P of each
        K/V heads are replicated first when Hkv does not split over P.
    deepspeed_ulysses also all-gathers position_ids (int64) once per forward.
    """
    if P == 1:
        return 0
    e = DTYPE_BYTES[dtype]
    acc = max(e, 4)  # accumulation dtype: promote(dtype, fp32)
    S_l = S // P
    q_elems = B * Hq * S_l * D

    def ulysses(U):
        if Hq % U:
            return uneven_ulysses(U), None
        rep = math.lcm(Hkv, U) // Hkv
        kv_elems = B * Hkv * rep * S_l * D
        frac = (U - 1) / U
        return 2 * frac * (q_elems + 2 * kv_elems + q_elems) * e, rep

    def uneven_ulysses(U):
        """Query heads dealt to ranks in order, the first Hq % U ranks one more; each rank
        receives every K/V head one of its query heads reads. Walk what each rank sends."""
        owner = []
        for r in range(U):
            owner += [r] * (Hq // U + (r < Hq % U))
        readers = [{owner[q] for q in range(Hq) if q * Hkv // Hq == kv} for kv in range(Hkv)]
        head = B * S_l * D * e  # one head of one rank's tokens
        sent = []
        for i in range(U):
            q_out = sum(owner[q] != i for q in range(Hq))  # my tokens of the others' query heads
            kv_out = sum(len(ranks - {i}) for ranks in readers)  # my tokens of the K/V heads they read
            mine, my_kv = owner.count(i), sum(i in ranks for ranks in readers)
            forward = q_out + 2 * kv_out + (U - 1) * mine  # q, k, v out; my heads' output back
            backward = q_out + (U - 1) * mine + 2 * (U - 1) * my_kv  # dout like q; dq, dk, dv back
            sent.append((forward + backward) * head)
        return max(sent)

    def ring(R, kv_elems):
        if R == 1:
            return 0
        return 2 * (R - 1) * kv_elems * e * 2 + 2 * (R - 1) * kv_elems * acc

    if config == "zigzag_ring_attn":
        return ring(P, B * Hkv * S_l * D)
    if config in ("ulysses_attn", "usp_attn"):  # usp_attn is run with its default ring_degree=1
        return ulysses(P)[0]
    return None


def walked_dist_flash_bytes(rounds, S, P, B, Hq, Hkv, D, dtype):
    """Bytes per rank (the busiest) per fwd+bwd for dist_flash_attn, walking its schedule.

    Every round t >= 1, for each unit whose worker is not the owner of its queries or K/V:
        forward   q-owner -> worker: its query rows;  kv-owner -> worker: K and V
                  worker -> q-owner: partial out rows + their lse (fp32)
        backward  q-owner -> worker: q, dout, out rows + lse;  kv-owner -> worker: K and V
                  worker -> q-owner: dq rows (fp32);  worker -> kv-owner: dK and dV (fp32)
    """
    e, acc = DTYPE_BYTES[dtype], max(DTYPE_BYTES[dtype], 4)
    S_l = S // P
    sent = [0] * P
    for units in rounds[1:]:
        for u in units:
            rows = len(range(S_l)[u.rows(S_l)])
            q_rows, lse_rows, kv = B * Hq * rows * D, B * Hq * rows, B * Hkv * S_l * D
            if u.q_owner != u.worker:
                sent[u.q_owner] += q_rows * e + (3 * q_rows * e + lse_rows * 4)
                sent[u.worker] += q_rows * e + lse_rows * 4 + q_rows * acc
            if u.kv_owner != u.worker:
                sent[u.kv_owner] += 2 * kv * e * 2
                sent[u.worker] += 2 * kv * acc
    return max(sent)


def configurations():
    """(mode, S, P, B, Hq, Hkv, D, dtype) that the mode runs at its default split."""
    for name, P, (Hq, Hkv), D, B, dtype, k in itertools.product(
        [m for m in BUILT_MODES if get_mode(m).sequence_parallel],
        (1, 2, 3, 4, 6, 8),
        ((8, 8), (8, 2), (12, 4), (6, 3), (4, 1)),
        (64, 24),
        (1, 2),
        DTYPE_BYTES,
        (1, 3),
    ):
        mode = get_mode(name)
        topology = mode.topology(P)
        if Hq < topology.ulysses_degree:  # the mode refuses a rank without a query head
            continue
        S = mode.layout(topology).multiple * 16 * k
        yield name, S, P, B, Hq, Hkv, D, dtype


def shape_of(name, S, P, B, Hq, Hkv, D, dtype):
    topology = get_mode(name).topology(P)
    return AttentionShape(Hq, Hkv, D, DTYPE_BYTES[dtype], topology.sp_size, topology.ring_degree, S, B)


def test_mode_traffic_equals_an_independent_derivation():
    checked = set()
    for name, S, P, B, Hq, Hkv, D, dtype in configurations():
        ours = get_mode(name).traffic(shape_of(name, S, P, B, Hq, Hkv, D, dtype)).total
        if name == "dist_flash_attn":
            theirs = walked_dist_flash_bytes(balanced_schedule(P), S, P, B, Hq, Hkv, D, dtype)
        else:
            theirs = reference_bytes(name, S, P, B, Hq, Hkv, D, dtype)
        # the benchmark multiplies by (P - 1) / P in floating point
        assert math.isclose(ours, theirs, rel_tol=1e-12), (name, S, P, B, Hq, Hkv, D, dtype, ours, theirs)
        checked.add((name, P))
    assert {name for name, _ in checked} == {m for m in BUILT_MODES if get_mode(m).sequence_parallel}
    assert len(checked) >= 20


def test_dist_flash_busiest_rank_is_found_for_every_size():
    # the closed form against a walk over the real schedule, at every size up to 40 ranks
    for P in range(1, 41):
        for S, (Hq, Hkv), dtype in itertools.product((P * 6, P * 7), ((8, 8), (8, 2), (3, 1)), DTYPE_BYTES):
            shape = AttentionShape(Hq, Hkv, 16, DTYPE_BYTES[dtype], P, P, S, 2)
            walked = walked_dist_flash_bytes(balanced_schedule(P), S, P, 2, Hq, Hkv, 16, dtype)
            assert balanced_schedule_traffic(shape).total == walked, (P, S, Hq, Hkv, dtype)


def test_traffic_splits_into_ring_and_all_to_all():
    shape = AttentionShape(8, 2, 64, 2, sp_size=8, ring_degree=2, seq_len=8192)
    usp = get_mode("usp_attn").traffic(shape)
    assert usp.p2p_forward > 0 and usp.all_to_all_forward > 0
    assert usp.all_to_all_forward == usp.all_to_all_backward
    ring = get_mode("zigzag_ring_attn").traffic(AttentionShape(8, 2, 64, 2, sp_size=8, ring_degree=8, seq_len=8192))
    assert ring.all_to_all_forward == 0 and ring.p2p_backward > ring.p2p_forward  # + fp32 dK/dV going back
    ulysses = get_mode("ulysses_attn").traffic(AttentionShape(8, 2, 64, 2, sp_size=8, ring_degree=1, seq_len=8192))
    assert ulysses.p2p_forward == ulysses.p2p_backward == 0
    assert get_mode("data_parallel").traffic(AttentionShape(8, 2, 64, 2, seq_len=8192)) == Traffic()
    for name in BUILT_MODES:  # one rank sends nothing
        assert get_mode(name).traffic(AttentionShape(8, 2, 64, 2, seq_len=8192)).total == 0


def test_activation_declarations():
    a = 2
    zigzag = get_mode("zigzag_ring_attn").activations(AttentionShape(8, 2, 64, a, 4, 4))
    assert zigzag.kv_replication == 1 and zigzag.saved == 0 and zigzag.kept_for_recompute == 0
    assert zigzag.backward_buffers == 2 * a * 2 * 128 + 2 * 4 * 2 * 128
    ulysses = get_mode("ulysses_attn").activations(AttentionShape(8, 2, 64, a, 4, 1))
    assert ulysses.kv_replication == 2 and ulysses.saved == a * 8 * 64
    dist_flash = get_mode("dist_flash_attn")
    assert (
        dist_flash.keeps_attention_output
        and dist_flash.activations(AttentionShape(8, 2, 64, a, 4, 4)).kept_for_recompute
    )
    assert not any(get_mode(m).keeps_attention_output for m in BUILT_MODES if m != dist_flash.name)
    assert get_mode("data_parallel").activations(AttentionShape(8, 2, 64, a)).backward_buffers == 0


def test_split_declarations():
    assert modes_with("takes_ring_degree") == ("usp_attn",)
    assert get_mode("usp_attn").ring_degrees_to_plan(12) == (2, 3, 4, 6)
    assert get_mode("zigzag_ring_attn").ring_degrees_to_plan(4) == (4,)
    assert get_mode("ulysses_attn").ring_degrees_to_plan(4) == (1,)
    assert get_mode("data_parallel").ring_degrees_to_plan(1) == (1,)
    assert all(get_mode(m).ring_degrees_to_plan(1) == () for m in BUILT_MODES if get_mode(m).sequence_parallel)
    assert get_mode("data_parallel").ring_degrees_to_plan(4) == ()


def mode_name_literals(path: Path):
    """(line, what) for each mode name the file compares with or lists."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            parts = node.elts
        elif isinstance(node, ast.Dict):
            parts = [k for k in node.keys if k is not None]
        else:
            continue
        for part in parts:
            for leaf in ast.walk(part):
                if isinstance(leaf, ast.Constant) and leaf.value in MODE_NAMES:
                    found.add((leaf.lineno, leaf.col_offset, leaf.value))
    return sorted((line, name) for line, _, name in found)


def test_recipes_ask_the_mode_instead_of_comparing_names():
    files = sorted((ROOT / "recipes").rglob("*.py")) + sorted(ROOT.glob("train.py")) + sorted(ROOT.glob("eval_*.py"))
    assert len(files) > 5
    found = {str(path.relative_to(ROOT)): hits for path in files if (hits := mode_name_literals(path))}
    assert found == {}


def test_the_check_sees_a_comparison(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('if mode == "usp_attn" or m in ("zigzag_ring_attn", "x"):\n    pass\nMODES = ["ulysses_attn"]\n')
    assert mode_name_literals(sample) == [(1, "usp_attn"), (1, "zigzag_ring_attn"), (3, "ulysses_attn")]
