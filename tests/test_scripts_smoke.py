"""The benchmark scripts run end to end at a tiny size and print well-formed tables."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def table_rows(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


@pytest.mark.timeout(300)
def test_bench_train_smoke(tmp_path):
    csv_path = tmp_path / "train.csv"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--smoke", "--exact-memory",
                          "--csv", str(csv_path)], capture_output=True, text=True, timeout=280, check=True).stdout
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
def test_bench_attention_smoke(tmp_path):
    csv_path = tmp_path / "attention.csv"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention.py"), "--smoke", "--world-sizes", "1,2",
                          "--csv", str(csv_path)], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, *rows = table_rows(out.stdout)
    assert header[:4] == ["config", "S", "P", "time (s)"]
    ours = {(r[0], r[2]) for r in rows if r[3] and float(r[3]) > 0}
    for mode in ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"):
        assert (mode, "2") in ours, (mode, out.stdout[-2000:])
    assert ("baseline", "1") in ours
    assert len(csv_path.read_text().splitlines()) == len(rows) + 1
