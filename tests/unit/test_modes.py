"""Modes declare what they support and what they cost; the programs ask them.

The cost declarations (easy_context/modes/costs.py and each mode's MODE) give the figures of
the attention benchmark's analytic communication model, whose numbers docs/benchmarks.md shows
equal to the bytes counted on the wire; the planner, train.py and the eval scripts compare no
mode names."""

import ast
import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest

from easy_context.modes import BUILT_MODES, MODE_NAMES, get_mode, modes_with
from easy_context.modes.costs import AttentionShape, Traffic, balanced_schedule_traffic
from easy_context.modes.dist_flash_attn import balanced_schedule

ROOT = Path(__file__).resolve().parents[2]
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def load_bench_attention():
    """The attention benchmark's module, wherever it lives (scripts/ or benchmarks/)."""
    candidates = [path for folder in ("scripts", "benchmarks", "tools") for path in sorted((ROOT / folder).rglob("*.py"))
                  if "def analytic_comm_bytes(" in path.read_text()]
    assert candidates, "no benchmark defines analytic_comm_bytes under scripts/, benchmarks/ or tools/"
    path = candidates[0]
    spec = importlib.util.spec_from_file_location("bench_attention_under_test", path)
    module = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)
    try:
        spec.loader.exec_module(module)  # it puts its own folder on sys.path for its helpers
    finally:
        sys.path[:] = saved_path
    return module


@pytest.fixture(scope="module")
def bench():
    return load_bench_attention()


def configurations():
    """(mode, S, P, B, Hq, Hkv, D, dtype) that the mode runs at its default split."""
    for name, P, (Hq, Hkv), D, B, dtype, k in itertools.product(
            [m for m in BUILT_MODES if get_mode(m).sequence_parallel], (1, 2, 3, 4, 6, 8),
            ((8, 8), (8, 2), (12, 4), (6, 3), (4, 1)), (64, 24), (1, 2), DTYPE_BYTES, (1, 3)):
        mode = get_mode(name)
        topology = mode.topology(P)
        if Hq % topology.ulysses_degree:  # the mode refuses these heads (models.check_config)
            continue
        S = mode.layout(topology).multiple * 16 * k
        yield name, S, P, B, Hq, Hkv, D, dtype


def shape_of(name, S, P, B, Hq, Hkv, D, dtype):
    topology = get_mode(name).topology(P)
    return AttentionShape(Hq, Hkv, D, DTYPE_BYTES[dtype], topology.sp_size, topology.ring_degree, S, B)


def test_mode_traffic_equals_the_benchmarks_analytic_bytes(bench):
    checked = set()
    for name, S, P, B, Hq, Hkv, D, dtype in configurations():
        ours = get_mode(name).traffic(shape_of(name, S, P, B, Hq, Hkv, D, dtype)).total
        if name == "dist_flash_attn":
            theirs = bench.dist_flash_comm_bytes(balanced_schedule(P), S, P, B, Hq, Hkv, D, dtype)
        else:
            theirs = bench.analytic_comm_bytes(name, S, P, B, Hq, Hkv, D, dtype)
        # the benchmark multiplies by (P - 1) / P in floating point
        assert math.isclose(ours, theirs, rel_tol=1e-12), (name, S, P, B, Hq, Hkv, D, dtype, ours, theirs)
        checked.add((name, P))
    assert {name for name, _ in checked} == {m for m in BUILT_MODES if get_mode(m).sequence_parallel}
    assert len(checked) >= 20


def test_dist_flash_busiest_rank_is_found_for_every_size(bench):
    # the closed form against a walk over the real schedule, at every size up to 40 ranks
    for P in range(1, 41):
        for S, (Hq, Hkv), dtype in itertools.product((P * 6, P * 7), ((8, 8), (8, 2), (3, 1)), DTYPE_BYTES):
            shape = AttentionShape(Hq, Hkv, 16, DTYPE_BYTES[dtype], P, P, S, 2)
            walked = bench.dist_flash_comm_bytes(balanced_schedule(P), S, P, 2, Hq, Hkv, 16, dtype)
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
    assert dist_flash.keeps_attention_output and dist_flash.activations(AttentionShape(8, 2, 64, a, 4, 4)).kept_for_recompute
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


def test_programs_ask_the_mode_instead_of_comparing_names():
    files = sorted((ROOT / "easy_context" / "programs").rglob("*.py")) + sorted(ROOT.glob("train.py")) + sorted(
        ROOT.glob("eval_*.py"))
    assert len(files) > 5
    found = {str(path.relative_to(ROOT)): hits for path in files if (hits := mode_name_literals(path))}
    assert found == {}


def test_the_check_sees_a_comparison(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('if mode == "usp_attn" or m in ("zigzag_ring_attn", "x"):\n    pass\nMODES = ["ulysses_attn"]\n')
    assert mode_name_literals(sample) == [(1, "usp_attn"), (1, "zigzag_ring_attn"), (3, "ulysses_attn")]
