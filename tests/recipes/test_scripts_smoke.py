"""The benchmark scripts run end to end at a tiny size and print well-formed tables."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
BENCH_ATTENTION = [sys.executable, "-m", "benchmarks.bench_attention"]  # run from ROOT


def run_module(module: str, *flags: str, timeout: int) -> str:
    """`python -m module flags` from the repository root; its stdout (a failure fails the test)."""
    command = [sys.executable, "-m", module, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True, cwd=ROOT).stdout


def table_rows(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


@pytest.mark.timeout(300)
def test_bench_train_smoke(tmp_path):
    csv_path = tmp_path / "train.csv"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_train", "--smoke", "--exact-memory", "--csv", str(csv_path)],
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
        cwd=ROOT,
    ).stdout
    steps, fits = out.split("longest context within")
    header, *rows = table_rows(steps)
    assert header[:2] == ["config", "S"] and len(rows) == 6
    names = ["hf-plain", "zigzag_ring_attn P=2", "zigzag_ring_attn P=2 +mem"]
    assert [r[0] for r in rows] == names * 2 and [r[1] for r in rows] == ["512"] * 3 + ["1024"] * 3
    for row in rows:
        assert float(row[2]) > 0 and float(row[4]) >= 0 and float(row[6]) > 0  # tokens/s and measured peaks
    fit_header, *fit_rows = table_rows(fits)
    assert fit_header[:2] == ["config", "slope KiB/token/rank"] and [r[0] for r in fit_rows] == names
    assert all(float(r[2]) > 0 for r in fit_rows)  # the fixed part: at least the model and runtime
    assert len(csv_path.read_text().splitlines()) == 7
    assert len((tmp_path / "train_fit.csv").read_text().splitlines()) == 4


@pytest.mark.timeout(300)
def test_bench_sharding_smoke(tmp_path):
    """train.py's per-rank peak under DDP, FSDP2 (and DeepSpeed ZeRO-3 with offload where
    installed) at a tiny size: every row measured, next to the planner's prediction for it. (One
    row per engine: each row is a train.py run, ~12 s of CI; the full table is the benchmark's.)"""
    import importlib.util

    configs = ["ddp", "fsdp2-offload"]
    if os.environ.get("EASY_CONTEXT_REQUIRE_DEEPSPEED") == "1" or importlib.util.find_spec("deepspeed"):
        configs += ["zero3"]
    csv_path = tmp_path / "sharding.csv"
    command = [sys.executable, "-m", "benchmarks.bench_sharding", "--smoke", "--exact-memory"]
    out = subprocess.run(
        [*command, "--configs", ",".join(configs), "--csv", str(csv_path)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, *rows = table_rows(out.stdout)
    assert header[:6] == ["config", "S", "step s", "peak MiB/rank (max)", "predicted MiB/rank", "measured / predicted"]
    assert [r[0] for r in rows] == configs and {r[1] for r in rows} == {"512"}
    for row in rows:  # measured and predicted: at least the runtime; their ratio near 1 at this size
        assert float(row[2]) > 0 and float(row[3]) > 100 and float(row[4]) > 100 and 0.5 < float(row[5]) < 2, row
    assert len(csv_path.read_text().splitlines()) == len(configs) + 1


@pytest.mark.timeout(300)
def test_bench_attention_smoke(tmp_path):
    csv_path = tmp_path / "attention.csv"
    out = subprocess.run(
        [*BENCH_ATTENTION, "--smoke", "--world-sizes", "1,2", "--csv", str(csv_path)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, *rows = table_rows(out.stdout)
    assert header[:4] == ["config", "S", "P", "time (s)"]
    ours = {(r[0], r[2]) for r in rows if r[3] and float(r[3]) > 0}
    for mode in ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"):
        assert (mode, "2") in ours, (mode, out.stdout[-2000:])
    assert ("baseline", "1") in ours
    assert len(csv_path.read_text().splitlines()) == len(rows) + 1


@pytest.mark.timeout(150)
def test_bench_attention_masked_smoke(tmp_path):
    """--smoke-masks: every kind of mask through zigzag_ring_attn and dist_flash_attn at S=256, P=2,
    each checked against SDPA with the dense mask; then the summary against the causal rows."""
    csv_path = tmp_path / "masked.csv"
    out = subprocess.run(
        [*BENCH_ATTENTION, "--smoke-masks", "--csv", str(csv_path)],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    main_table, summary = out.stdout.split("masked rows against the same mode's causal row")
    header, *rows = table_rows(main_table)
    assert header[:4] == ["config", "S", "P", "time (s)"] and header[-3:] == ["mask", "allowed ratio", "notes"]
    modes, masks = ("zigzag_ring_attn", "dist_flash_attn"), ("causal", "packed-64", "long-tail", "window-64")
    assert sorted((r[0], r[-3]) for r in rows) == sorted((m, k) for m in modes for k in masks)
    for row in rows:
        assert row[1:3] == ["256", "2"] and float(row[3]) > 0 and "max err" in row[-1], row
    ratio = {r[-3]: float(r[-2]) for r in rows}
    assert ratio["causal"] == 1.0 and ratio["packed-64"] == pytest.approx(4 * 64 * 65 / (256 * 257), abs=1e-3)
    assert 0 < ratio["window-64"] < 1 and 0 < ratio["long-tail"] <= 1

    summary_header, *summary_rows = table_rows(summary)
    assert summary_header == [
        "mode",
        "mask",
        "S",
        "P",
        "time s",
        "causal time s",
        "time ratio",
        "ideal ratio (allowed/causal)",
        "saving achieved / ideal saving",
    ]
    assert sorted((r[0], r[1]) for r in summary_rows) == sorted((m, k) for m in modes for k in masks[1:])
    for row in summary_rows:
        assert row[2:4] == ["256", "2"] and float(row[5]) > 0 and float(row[6]) > 0  # a causal row was found
        assert float(row[7]) == ratio[row[1]] and " / " in row[8]

    # the CSV keeps the old columns first; --from-csv reads it back, and reads CSVs without masks as causal
    lines = csv_path.read_text().splitlines()
    assert len(lines) == len(rows) + 1 and lines[0].endswith(",mask,allowed_ratio")
    again = subprocess.run(
        [*BENCH_ATTENTION, "--from-csv", str(csv_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    ).stdout
    assert "masked rows against the same mode's causal row" in again
    old_csv = tmp_path / "old.csv"
    old_csv.write_text("\n".join(line.rsplit(",", 2)[0] for line in lines[:3]) + "\n")
    old = subprocess.run(
        [*BENCH_ATTENTION, "--from-csv", str(old_csv)], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT
    ).stdout
    assert [r[-3] for r in table_rows(old)[1:]] == ["causal", "causal"] and "masked rows" not in old


@pytest.mark.timeout(300)
def test_bench_attention_peers_smoke(tmp_path):
    """--peers all at S=256, P=2: every peer has its row, timed with its errors against SDPA or with
    the reason it cannot run (never a failed run); lucidrains' wrong dK/dV are flagged WRONG."""
    import importlib.util

    from benchmarks import bench_peers

    csv_path = tmp_path / "peers.csv"
    out = subprocess.run(
        [
            *BENCH_ATTENTION,
            "--smoke",
            "--world-sizes",
            "2",
            "--modes",
            "zigzag_ring_attn",
            "--peers",
            "all",
            "--csv",
            str(csv_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    main_table, summary = out.stdout.split("peers: errors against SDPA")
    rows = {r[0]: r for r in table_rows(main_table)[1:]}
    assert "zigzag_ring_attn" in rows and "Traceback" not in out.stderr
    installed = {p: importlib.util.find_spec(m) is not None for p, (m, _) in bench_peers.PACKAGES.items()}
    for peer in bench_peers.PEERS:
        row = rows[peer]
        assert row[1:3] == ["256", "2"] and row[-1], row
        if not installed[peer.split("_", 1)[0]]:
            assert row[3] == "" and row[-1].startswith("not installed"), row
        elif row[3]:  # ran: timed, with all four errors
            assert float(row[3]) > 0 and all(f"{k} " in row[-1] for k in ("out", "dq", "dk", "dv")), row
        else:  # could not run: says why, in one line
            assert "fails:" in row[-1] or "Error" in row[-1], row
    if installed["ringmaster"]:
        for peer in ("ringmaster_p2p", "ringmaster_zigzag_varlen", "ringmaster_distflash", "ringmaster_ulysses"):
            assert rows[peer][3] and "WRONG" not in rows[peer][-1], rows[peer]
        assert "requires the CUDA flash kernel" in rows["ringmaster_zigzag"][-1]
    if installed["lucidrains"]:  # its ring backward hands back the wrong buffers as dK/dV (docs/benchmarks.md)
        for peer in ("lucidrains_ring", "lucidrains_striped"):
            assert "WRONG: dk err" in rows[peer][-1] and "dv err" in rows[peer][-1], rows[peer]

    header, *peer_rows = table_rows(summary)
    assert header[:4] == ["peer", "S", "P", "time (s)"] and header[5:10] == [
        "err out",
        "err dq",
        "err dk",
        "err dv",
        "exact",
    ]
    assert [r[0] for r in peer_rows] == bench_peers.PEERS
    for r in peer_rows:
        if r[9] == "yes":  # an exact peer gets our fastest / lowest-peak mode's ratios
            assert r[10].endswith("(zigzag_ring_attn)") and float(r[10].split()[0]) > 0, r
    assert len(csv_path.read_text().splitlines()) == len(rows) + 1
    again = subprocess.run(
        [*BENCH_ATTENTION, "--from-csv", str(csv_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    ).stdout
    assert "peers: errors against SDPA" in again


@pytest.mark.timeout(200)
def test_bench_replica_check_smoke():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "benchmarks.bench_replica_check",
            "--seq-lengths",
            "256",
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=190,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, *rows = table_rows(out.stdout)
    assert header[0] == "seq len" and [r[0] for r in rows] == ["256"] and float(rows[0][1]) > 0
    assert "one check" in out.stdout


def run_example(script: str, processes: int, *flags: str, timeout: int) -> subprocess.CompletedProcess:
    """examples/<script> under torchrun on `processes` CPU processes; it must exit 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    out = subprocess.run(
        [*command, str(ROOT / "examples" / script), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("flags", [[], ["--sft", "--mode", "ulysses_attn"]], ids=["trainer", "sft"])
def test_hf_trainer_example(tmp_path, flags):
    """examples/hf_trainer.py: the README's Trainer script, 2 steps on 2 CPU processes."""
    out = run_example("hf_trainer.py", 2, "--max-steps", "2", "--output-dir", str(tmp_path), *flags, timeout=190)
    assert "'eval_loss'" in out.stdout


@pytest.mark.timeout(120)
def test_dpo_example(tmp_path):
    """examples/dpo.py: TRL's DPOTrainer, one step on 2 CPU processes (zigzag_ring_attn; short
    prompts: about 11 s). Its exactness is tests/distributed/test_dpo_trainer.py's."""
    flags = ("--max-steps", "1", "--prompt-chars", "200", "--output-dir", str(tmp_path))
    out = run_example("dpo.py", 2, *flags, timeout=110)
    assert "'eval_loss'" in out.stdout


@pytest.mark.timeout(120)
def test_grpo_example(tmp_path):
    """examples/grpo.py: TRL's GRPOTrainer, one step on 2 CPU processes (zigzag_ring_attn: the
    rollout by sharded generation, the log-prob forwards sharded). Its exactness is
    tests/distributed/test_grpo_trainer.py's."""
    flags = ("--max-steps", "1", "--completion-tokens", "8", "--output-dir", str(tmp_path))
    out = run_example("grpo.py", 2, *flags, timeout=110)
    assert "'train_loss'" in out.stdout


@pytest.mark.timeout(120)
def test_bench_rl_smoke():
    """benchmarks/bench_rl.py at 256 completion tokens: TRL's GRPOTrainer in one process, then
    prepare_trainer's at 2 ranks, each a row with its step time and peak."""
    out = run_module("benchmarks.bench_rl", "--smoke", timeout=110)
    header, *rows = table_rows(out)
    assert header[:3] == ["config", "completion tokens", "step s"] and [r[0] for r in rows] == [
        "trl P=1",
        "zigzag_ring_attn P=2",
    ]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows), rows


@pytest.mark.timeout(120)
def test_the_training_loop_example_equals_one_process():
    """examples/training_loop.py (the docs' and the README's custom loop): its losses at 2 ranks
    (zigzag_ring_attn) equal those of one unpatched process on the whole sequence."""

    def losses(processes, *flags):
        out = run_example("training_loop.py", processes, "--seq-length", "512", *flags, timeout=110)
        return [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step ")]

    sharded, whole = losses(2), losses(1, "--mode", "data_parallel")
    assert len(sharded) == len(whole) == 3
    assert sharded == pytest.approx(whole, rel=1e-5, abs=1e-6), (sharded, whole)


@pytest.mark.timeout(300)
def test_bench_generate_smoke(tmp_path):
    csv_path = tmp_path / "generate.csv"
    flags = ("--smoke", "--modes", "zigzag_ring_attn", "--csv", str(csv_path))
    out = run_module("benchmarks.bench_generate", *flags, timeout=280)
    header, *rows = table_rows(out)
    assert header[:4] == ["config", "S", "first token s", "ms/token"] and len(rows) == 4
    assert [r[0] for r in rows] == ["hf", "zigzag_ring_attn P=2"] * 2 and [r[1] for r in rows] == ["1000"] * 2 + [
        "2000"
    ] * 2
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0 and float(row[5]) > 0  # first token, ms/token, KV MiB
    for row in rows[1::2]:  # the sharded cache: about half of one process's (plus its spare slots)
        assert 0.4 < float(row[6]) < 0.8 and float(row[10]) > 0
    assert len(csv_path.read_text().splitlines()) == 5


@pytest.mark.timeout(300)
def test_bench_mixers_smoke():
    """One family under one process and both strategies: the bytes counted equal the declared
    ones, and the crossover length is printed."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_mixers",
            "--seq-lengths",
            "256",
            "--repeats",
            "1",
            "--families",
            "mamba2",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
        cwd=ROOT,
    ).stdout
    header, *rows = table_rows(out)
    assert header[:3] == ["family", "S", "setting"] and len(rows) == 3
    for row in rows:
        assert float(row[3]) > 0 and row[5] == row[6], row  # seconds; sent == declared
    assert "mamba2: state passing sends fewer bytes than head exchange from S = 204" in out


@pytest.mark.timeout(300)
def test_bench_long_context_dry_run(tmp_path):
    """The headline benchmark's CPU dry run (configs/tiny-llama): every full-depth row trained,
    with the planner's predictions beside it, the ceiling and the host line, and its JSON."""
    import json

    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_long_context", "--dry-run", "--json", str(tmp_path / "lc.json")],
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
        cwd=ROOT,
    ).stdout
    table = out.split("\n\n")[-2] if "\n\n" in out else out
    header, *rows = table_rows(table)
    assert header[:3] == ["S", "layers", "result"] and "planner peak GiB" in header
    assert [r[0] for r in rows] == ["256", "512"] and all(r[2] == "trained" for r in rows), out
    for row in rows:
        cells = dict(zip(header, row))
        assert float(cells["tokens/s"].replace(",", "")) > 0 and 0 < float(cells["MFU"]) <= float(cells["HFU"])
        assert float(cells["planner step s"]) > 0 and float(cells["planner peak GiB"]) > 0
    assert "Ceiling: the longest S that trained is 2,048 tokens" in out, out and "Host: full depth at 2,048" in out
    report = json.loads((tmp_path / "lc.json").read_text())
    assert report["ceiling"]["longest_seq"] == 2048 and report["host"]["host_bytes_needed"] > 0


@pytest.mark.timeout(120)
def test_bench_layouts_smoke():
    """benchmarks/bench_layouts.py at S=2K, P=2: the three layouts of both modes, each with its
    counted bytes, its balance and a predicted GPU time; the workload layout sends less than cut."""
    out = run_module("benchmarks.bench_layouts", "--smoke", timeout=110)
    assert "attention 326 TFLOP/s, link 450 GB/s one way, latency 10 us per transfer" in out, out
    header, *rows = table_rows(out)[:7]
    assert header[:3] == ["mode", "P", "layout"] and header[-2:] == ["predicted GPU ms/row", "predicted x cut"]
    assert [r[2] for r in rows] == ["static", "cut", "workload"] * 2, rows
    assert all(float(r[-2]) > 0 for r in rows) and all(float(r[7]) < 1 for r in rows if r[2] == "workload"), rows
