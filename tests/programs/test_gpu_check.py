"""scripts/gpu_check.sh and the checks it runs, on a machine without a GPU.

The dry run runs every section at CPU sizes; check_kernels must fail a wrong backend and
bench_kernels must time our layer next to SDPA with matching outputs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from easy_context.core import kernels
from tools import check_kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_check_kernels_passes_every_cpu_backend():
    rows = check_kernels.check(torch.device("cpu"), torch.bfloat16, 128, 32)
    assert {r["backend"] for r in rows} == set(kernels.available_backends("cpu", torch.bfloat16, 32))
    assert {r["case"] for r in rows} == {"causal", "rectangular", "documents"}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


@pytest.mark.timeout(60)
def test_check_kernels_fails_a_wrong_backend(monkeypatch):
    """A backend whose gradient is off by 1% (well inside bf16's eps of 2^-8 relative per
    element, but not of its sum over a row) and one whose lse is off by 1e-3 fail their rows."""
    math = kernels.BACKENDS["math"]

    def bad_backward(*args, **kwargs):
        dq, dk, dv = math.backward(*args, **kwargs)
        return dq, dk * 1.01, dv

    def bad_forward(*args, **kwargs):
        out, lse = math.forward(*args, **kwargs)
        return out, lse + 1e-3 * lse.abs()

    monkeypatch.setitem(kernels.BACKENDS, "math", math._replace(backward=bad_backward))
    rows = check_kernels.check(torch.device("cpu"), torch.float32, 128, 32)
    assert [r["ok"] for r in rows if r["backend"] == "math"] == [False] * 3
    assert all(r["ok"] for r in rows if r["backend"] != "math")
    monkeypatch.setitem(kernels.BACKENDS, "math", math._replace(forward=bad_forward))
    rows = check_kernels.check(torch.device("cpu"), torch.float32, 128, 32)
    assert [r["lse_relative"] > 5e-4 and not r["ok"] for r in rows if r["backend"] == "math"] == [True] * 3


@pytest.mark.timeout(120)
def test_bench_kernels_rows(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_kernels",
            "--device",
            "cpu",
            "--seq-len",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "32",
            "--iters",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("sdpa", "kernel:cpu_flash", "kernel:math", "zigzag_ring_attn P=1", "dist_flash_attn P=1"):
        assert rows[name]["ms"] > 0 and rows[name]["max_err"] < 1e-5, (name, rows[name])
    assert rows["flash_attn"].get("ms") or rows["flash_attn"]["error"].startswith("not installed")


@pytest.mark.timeout(1260)
def test_gpu_check_dry_run(tmp_path):
    """Every section passes on CPU (peers: skipped, not installed); one results file."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this interpreter's python
    env["PYTHON"] = sys.executable
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1240,
        env=env,
    )
    results = (tmp_path / "gpu_check.md").read_text()
    assert run.returncode == 0, run.stdout[-3000:] + results[-6000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.md"]
    # read in a minute: the summary and the speed table before the sections' output
    assert results.index("## Summary") < results.index("## Speed against flash SDPA") < results.index("## env")
    summary = results.split("## Summary")[1]
    for section in SECTIONS:
        assert f"| {section} | PASS |" in summary, summary
    masks = results.split("## masks")[1].split("## multirank")[0]
    for case in ("causal", "window", "documents"):  # timed on CPU; the CUDA backends say why not
        assert f"\nmath            {case}" in masks and f"SKIP cuda_efficient {case}: not usable" in masks
    multirank = results.split("## multirank")[1].split("## modes_p1")[0]
    assert "batch_isend_irecv    works" in multirank and "2 ranks over gloo, cpu tensors (exit 0)" in multirank
    assert multirank.count("  yes  (") == 6 and " NO " not in multirank  # 2 ring modes x 3 masks, simulated
    assert "unexercised here: NCCL" in multirank
    assert "| peers | SKIP |" in summary or "| peers | PASS |" in summary
    # the sections' own tables made it into the file
    assert "kernel backends vs fp64 on cpu" in results and "| all_bf16 |" in results
    assert results.count("ok") >= 8 and " NO" not in results.split("## bench")[0]
    # the several-GPU sections, over gloo here: every transfer exact, clean exits, a stuck rank bounded
    assert "| ulysses | all_to_all |" in results and "| ring | one_way_p2p |" in results and "| False |" not in results
    assert results.count("the process group torn down on all 2 ranks") == 2
    assert "rank 1 stuck, --dist-timeout 15 s" in results


SECTIONS = (
    "env", "toolchain", "kernels", "masks", "multirank", "modes_p1", "softcap", "modes_p2", "collectives_p2",
    "generate", "bench", "train", "exit_p2", "timeout_p2", "two_gpu", "compile",
)  # fmt: skip


def test_gpu_check_budget_fits_its_deadlines():
    """Every section has a limit on a GPU and in the dry run, and each column adds up to at most
    its default deadline (420 s on one H200: the device allows 600 s per command, start-up
    included; 1200 s on CPU), so no section is cut short by the ones before it. On several GPUs,
    the sections the two_gpu line names for `--only` fit the same 420 s."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    limits = [
        (name, int(gpu), int(dry))
        for name, gpu, dry in re.findall(r'\bsection "?([\w$]+)"? "\$\(limit (\d+) (\d+)\)"', script)
    ]
    assert {name.replace("$MULTI", "2") for name, _, _ in limits} == {*SECTIONS, "peers"}, limits
    deadlines = re.search(r'DEADLINE=\$\{DEADLINE:-\$\(\[ "\$DRY_RUN" = 1 \] && echo (\d+) \|\| echo (\d+)\)\}', script)
    dry_deadline, gpu_deadline = int(deadlines[1]), int(deadlines[2])
    one_gpu = [gpu for name, gpu, _ in limits if "$MULTI" not in name]  # _pN: several GPUs only
    assert gpu_deadline == 420 and sum(one_gpu) <= gpu_deadline, limits
    assert sum(dry for _, _, dry in limits) <= dry_deadline, limits
    several = re.search(r'SEVERAL_GPUS_ONLY="([\w,]+)"', script)[1].split(",")  # the default on several GPUs
    chosen = [gpu for name, gpu, _ in limits if name.replace("_p$MULTI", "").replace("_p1", "") in several]
    assert {"modes", "collectives", "exit", "timeout"} <= set(several) and sum(chosen) <= gpu_deadline, chosen


def test_gpu_check_refuses_bad_arguments(tmp_path):
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--frobnicate"], capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 2 and "unknown argument '--frobnicate'" in run.stderr
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHON"] = sys.executable
    # the dry run has 2 ranks: a section of 4 runs nothing, so it is refused like an unknown one
    for only, name in (("kernels,frob", "frob"), ("modes,timeout_p4", "timeout_p4")):
        run = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--only", only, "--out", str(tmp_path)],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert run.returncode == 2 and f"--only: no section '{name}' runs here" in run.stderr, run.stderr
        assert "timeout_p2" in run.stderr and not any(tmp_path.iterdir())  # the list; nothing written


@pytest.mark.timeout(180)
def test_gpu_check_deadline_reports_what_did_not_run(tmp_path):
    """A deadline too short for every section: the ones left out are reported as not run, the
    summary is still written, and the run fails."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHON"] = sys.executable
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--deadline", "30", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
    )
    summary = (tmp_path / "gpu_check.md").read_text().split("## Summary")[1]
    assert run.returncode == 1, run.stdout[-2000:]
    assert "| env | PASS |" in summary and "| train | FAIL (not run: the 30 s deadline was reached) |" in summary
