"""The planner (recipes/plan/): CLI, JSON, mode constraints, monotonicity, published
verdicts and error messages. Pure arithmetic: no distributed runs, seconds in all."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import plan as P

ROOT = Path(__file__).resolve().parents[2]


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "recipes.plan", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=100,
    )


def table_rows(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_table_and_json_agree():
    args = ["--model", "llama-3-8b", "--seq-length", "262144", "--gpus", "8", "--gpu", "h100-80g", "--top", "12"]
    out = cli(*args)
    assert out.returncode == 0, out.stderr
    header, *rows = table_rows(out.stdout)
    assert header == P.COLUMNS and len(rows) == 12
    assert "recommended:" in out.stdout and "--parallel-mode" in out.stdout
    js = cli(*args, "--json")
    assert js.returncode == 0, js.stderr
    data = json.loads(js.stdout)
    assert len(data["rows"]) == 12 and data["rows_total"] >= 12
    for cells, row in zip(rows, data["rows"]):
        assert cells == P.table_cells(int(cells[0]), row)
    best = data["recommendation"]
    assert best == data["rows"][0] and best["fits"]
    assert best["peak_gib"] <= 80 * 0.9
    # the recommendation is the fastest row that fits
    fitting = [r for r in data["rows"] if r["fits"]]
    assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in fitting)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_local_config_dir_and_cpu_device():
    out = cli("--model", "configs/tiny-llama", "--seq-length", "4096", "--gpus", "2", "--gpu", "cpu", "--json", "--all")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["model"]["hidden"] == 256 and data["model"]["kv_heads"] == 2 and data["dtype"] == "fp32"
    assert len(data["rows"]) == data["rows_total"]


def test_constraints_respected():
    # 3 query heads, 1 KV head: Ulysses 2 splits them 2 + 1, Ulysses 4 would leave a rank without one
    model = dataclasses.replace(P.PRESETS["tiny-bench"], heads=3, kv_heads=1, head_dim=64, hidden=192)
    ok, refused = P.layouts(model, 8192, 4)
    assert ("ulysses_attn", 4, 1) not in ok and ("ulysses_attn", 2, 1) in ok
    assert ("usp_attn", 4, 2) in ok  # Ulysses 2 x ring 2
    assert ("zigzag_ring_attn", 4, 4) in ok and ("dist_flash_attn", 4, 4) in ok
    assert any(m == "ulysses_attn" and s == 4 and "exceeds num_attention_heads=3" in why for m, s, r, why in refused)
    # lengths: zigzag over 4 ranks needs a multiple of 8, contiguous layouts of 4
    ok, refused = P.layouts(P.PRESETS["llama-3-8b"], 4100, 4)
    assert ("zigzag_ring_attn", 4, 4) not in ok and ("dist_flash_attn", 4, 4) in ok and ("ulysses_attn", 4, 1) in ok
    # every planned row is a layout the modes accept
    result = P.plan(model, 8192, 4, P.get_device("h100-80g"))
    for row in result["rows"]:
        assert P.check_layout(model, 8192, row["mode"], row["sp_size"], row["ring_degree"]) is None
        assert not (row["mode"] in ("ulysses_attn", "usp_attn") and model.heads < row["ulysses_degree"])


OPTION_STEPS = [
    lambda o, tile, chunk: dataclasses.replace(o, checkpointing=True),
    lambda o, tile, chunk: dataclasses.replace(o, offload_checkpoints=True) if o.checkpointing else o,
    lambda o, tile, chunk: dataclasses.replace(o, tiled_mlp=tile),
    lambda o, tile, chunk: dataclasses.replace(o, loss_chunk=chunk),
]
# each setting's next step in offload, and sharding over more than one rank (on one, DDP frees
# its gradients between steps where ZeRO-3 keeps its flat partitions: not a step down)
MORE_OFFLOAD = {"zero3": "zero3-opt-offload", "zero3-opt-offload": "zero3-offload"}
MORE_SHARDED_MANY_RANKS = {**MORE_OFFLOAD, "none": "zero3", "fsdp2": "fsdp2-offload"}


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3-8b", "tiny-bench"])
def test_monotonic(name):
    model, device = P.PRESETS[name], P.get_device("a100-80g")
    tile, chunk = P.default_tile(model), P.default_chunk(model)
    for gpus in (1, 2, 8):
        ok, _ = P.layouts(model, 65536, gpus)
        for layout in ok:
            for o in P.candidate_options(model, 65536, layout, P.ZERO_CHOICES, tile, chunk, gpus):
                peak = P.estimate(model, 65536, gpus, o, device)["peak_bytes"]
                for step in OPTION_STEPS:  # one more memory option never raises the peak
                    assert P.estimate(model, 65536, gpus, step(o, tile, chunk), device)["peak_bytes"] <= peak + 1, (
                        o,
                        step,
                    )
                more_sharded = (MORE_SHARDED_MANY_RANKS if gpus > 1 else MORE_OFFLOAD).get(o.zero)
                if more_sharded:
                    more = dataclasses.replace(o, zero=more_sharded)
                    assert P.estimate(model, 65536, gpus, more, device)["peak_bytes"] <= peak + 1, (o, more)
                # a longer sequence never lowers it
                assert P.estimate(model, 2 * 65536, gpus, o, device)["peak_bytes"] >= peak


def test_published_verdicts():
    from tools import validate_plan

    for what, published, fit, _margin_fit, peak in validate_plan.table_published():
        if published is not None:
            assert fit == published, (what, peak)


def test_measured_rows_within_15_percent():
    from tools import validate_plan

    errors = validate_plan.table_measured()
    assert len(errors) >= 6 and max(abs(e) for e in errors) <= 0.15


def run_main(capsys, *args):
    code = P.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_input_messages(capsys):
    out = cli("--model", "no-such-model-xyz", "--seq-length", "4096")  # through the real entry point once
    assert out.returncode == 2 and "unknown model 'no-such-model-xyz'" in out.stderr and "llama-3-8b" in out.stderr
    code, _, err = run_main(capsys, "--model", "llama-3-8b", "--seq-length", "4100", "--gpus", "8", "--sp-size", "8")
    assert code == 2 and "not divisible by" in err and "Sequence lengths must divide by" in err
    code, _, err = run_main(capsys, "--model", "llama-3-8b", "--seq-length", "4096", "--gpu", "tpu-v9")
    assert code == 2 and "unknown GPU 'tpu-v9'" in err and "h100-80g" in err
    code, _, err = run_main(
        capsys, "--model", "llama-3-70b", "--seq-length", "4194304", "--gpus", "8", "--gpu", "a100-40g"
    )
    assert code == 3 and "nothing fits" in err and "GiB per GPU" in err and "x a100-40g" in err
    code, _, err = run_main(capsys, "--model", "llama-3-8b", "--seq-length", "0")
    assert code == 2 and "--seq-length must be positive" in err
    code, _, err = run_main(capsys, "--model", "llama-3-8b", "--seq-length", "4096", "--mode", "ring")
    assert code == 2 and "unknown mode" in err


def test_no_fit_names_what_would_fit():
    model = P.PRESETS["llama-3-8b"]
    result = P.plan(model, 2_097_152, 2, P.get_device("h100-80g"))
    assert result["recommendation"] is None
    small = result["smallest"]
    assert small["gpus"] and small["gpus"] > 2 and small["memory_gib"] > 80
    bigger = P.plan(model, 2_097_152, small["gpus"], P.get_device("h100-80g"))
    assert bigger["recommendation"] is not None
    assert (
        P.plan(model, 2_097_152, 2, P.get_device("h100-80g", small["memory_gib"] + 0.5))["recommendation"] is not None
    )


def test_host_memory_column_and_check(capsys):
    """Llama-3-8B at 524K on one H100: the recipe that fits the GPU offloads 128 GiB of checkpoints
    (32 layers x 524288 x 4096 x 2 bytes) and ZeRO-3's 18 N = 134.6 GiB of states: 262.6 GiB of
    host memory, refused on a 64 or 256 GiB host with both numbers, planned on 512."""
    args = ["--model", "llama-3-8b", "--seq-length", "524288", "--gpus", "1", "--gpu", "h100-80g"]
    code, out, err = run_main(capsys, *args, "--host-memory", "64", "--all")
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert "needs 262.6 GiB of host memory per node, the host has 64.0 GiB (57.6 within the 10% margin)" in err
    header, *rows = table_rows(out)
    assert header == P.COLUMNS and "host GiB/node" in header
    host, fits = header.index("host GiB/node"), header.index("fits")
    assert {r[host] for r in rows if r[header.index("ZeRO / FSDP")] == "zero3" and r[5] == "yes"} == {"128.0"}
    assert [rows[0][host], rows[0][fits]] == ["262.6", "NO (host)"]
    code, out, err = run_main(capsys, *args, "--host-memory", "256")
    assert code == 3 and "needs 262.6 GiB of host memory per node, the host has 256.0 GiB" in err
    code, out, err = run_main(capsys, *args, "--host-memory", "512", "--json")
    data = json.loads(out)
    assert code == 0 and data["host_memory_gib"] == 512 and data["host_memory_source"] == "--host-memory"
    best = data["recommendation"]
    assert best["host_gib"] == pytest.approx(262.62, abs=0.01) and best["host_why"] is None
    assert best["host_terms_gib"]["offloaded checkpoints"] == 128.0
    code, out, _ = run_main(capsys, *args, "--host-memory", "512")
    assert "host memory: 262.62 GiB per node = 1 rank x:" in out and "offloaded checkpoints: 128.00 GiB" in out
    code, _, err = run_main(capsys, *args, "--host-memory", "0")
    assert code == 2 and "--host-memory must be positive, got 0.0" in err


@pytest.mark.timeout(60)
def test_one_host_memory_figure_and_small_parameter_counts(capsys):
    """The JSON gives the host memory the plan used once (host_memory_gib), not beside the
    named GPU's node default; the header counts a 3M-parameter model in M, not as 0.00B."""
    args = ["--model", "configs/tiny-llama", "--seq-length", "4096", "--gpus", "2", "--gpu", "cpu"]
    code, out, _ = run_main(capsys, *args, "--host-memory", "23.5", "--json")
    data = json.loads(out)
    assert code == 0 and data["host_memory_gib"] == 23.5
    assert not [key for key in data["device"] if "host" in key and key != "memory_is_host"], data["device"]
    code, out, _ = run_main(capsys, *args, "--host-memory", "23.5")
    assert out.startswith("model configs/tiny-llama: 3.03M params, hidden 256"), out.splitlines()[0]
    assert [P.parameter_count(n) for n in (8_030_261_248, 134_515_008, 12_500, 999_999, 900)] == [
        "8.03B",
        "135M",
        "12.5K",
        "1M",
        "900",
    ]
