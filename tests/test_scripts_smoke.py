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
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--smoke", "--csv", str(csv_path)],
                         capture_output=True, text=True, timeout=280, check=True).stdout
    header, *rows = table_rows(out)
    assert header[:2] == ["config", "S"] and len(rows) == 3
    assert [r[0] for r in rows] == ["hf-plain", "zigzag_ring_attn P=2", "zigzag_ring_attn P=2 +mem"]
    for row in rows:
        assert float(row[2]) > 0 and float(row[4]) >= 0  # tokens/s and a measured peak
    assert len(csv_path.read_text().splitlines()) == 4
