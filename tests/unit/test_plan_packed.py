"""The planner's layout for packed rows (recipes/plan/packed.py): each layout's attention
priced from the schedule the mode runs. No processes: the schedules are pure functions of the
mask."""

import random

from recipes import plan as P
from recipes.plan.packed import long_tailed_lengths, packed_mask, schedule_of, shares_of

SEQ, RING, HEADS = 16384, 4, (8, 2, 128)


def costs(layout: str, link: P.LinkModel, seed: int = 2) -> dict:
    mask = packed_mask(long_tailed_lengths(SEQ, random.Random(seed), shortest=64))
    schedule = schedule_of("zigzag_ring_attn", mask, SEQ, RING, shares_of(layout, mask, RING))
    return P.predict(P.round_costs(schedule, RING, SEQ // RING), *HEADS, link)


def test_the_time_model_follows_the_link_when_it_is_slow_and_the_work_when_it_is_fast():
    """On a link so slow that transfers decide, the layout that moves the fewest bytes is the
    fastest (static: whole documents stay home); on one so fast that compute decides, the
    static layout's imbalance makes it the slowest, and the two balanced layouts are within
    their balance of each other. A model that dropped either term fails one half."""
    slow, fast = P.LinkModel(tflops=300, link_gbs=0.01), P.LinkModel(tflops=300, link_gbs=1e6, latency_s=0.0)
    on_slow = {layout: costs(layout, slow) for layout in P.LAYOUTS}
    assert min(on_slow, key=lambda x: on_slow[x]["seconds"]) == min(on_slow, key=lambda x: on_slow[x]["bytes"])
    on_fast = {layout: costs(layout, fast)["seconds"] for layout in P.LAYOUTS}
    assert max(on_fast, key=on_fast.get) == "static", on_fast
    assert on_fast["workload"] <= 1.1 * on_fast["cut"], on_fast


def test_the_planner_picks_the_packed_layout_and_says_why(capsys):
    """`--packed-documents`: the recommended command carries the layout with the least
    predicted attention time (here workload, which sends a fraction of cut's bytes), and the
    plan prints every layout's prediction and the model's parameters; a mode with no layout
    per row gets none."""
    args = ["--model", "llama-3-8b", "--seq-length", "32768", "--gpus", "8", "--gpu", "h100", "--packed-documents"]
    assert P.main([*args, "--mode", "zigzag_ring_attn"]) == 0
    out = capsys.readouterr().out
    assert "--document-masking --balance-documents workload" in out, out
    why = next(line for line in out.splitlines() if "packed rows:" in line)
    assert "the workload layout" in why and all(f"{layout} " in why for layout in P.LAYOUTS), why
    assert "TFLOP/s" in why and "GB/s" in why and "latency" in why, why
    assert P.main([*args, "--mode", "ulysses_attn"]) == 0
    out = capsys.readouterr().out
    assert "--document-masking" in out and "--balance-documents" not in out and "packed rows:" not in out


def test_a_kv_row_that_travels_costs_its_bf16_kv_twice_and_its_fp32_gradients_back():
    """One round in which rank 1 borrows 3 K/V rows of rank 0 and nothing is computed: per row,
    K and V (2 heads of 128) in bf16 forward and again in the backward, 1,024 bytes each way,
    and their fp32 gradients back to the owner, 2,048 bytes; the time, one latency and the bytes
    over the link."""
    link = P.LinkModel(tflops=300, link_gbs=1.0, latency_s=1e-6, dtype_bytes=2)
    rounds = [{"products": [0, 0], "transfers": {(0, 1): (3, 0)}}]
    got = P.predict(rounds, 8, 2, 128, link)
    per_row = 2 * (2 * 2 * 128 * 2) + 2 * 2 * 128 * 4
    assert got["bytes"] == 3 * per_row == 3 * 4096, got
    assert abs(got["seconds"] - (1e-6 + 3 * per_row / 1e9)) < 1e-15, got
