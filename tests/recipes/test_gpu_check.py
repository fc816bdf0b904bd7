"""scripts/gpu_check.sh and the checks it runs, on a machine without a GPU.

The dry run runs every section at CPU sizes; check_kernels must fail a wrong backend and
bench_kernels must time our layer next to SDPA with matching outputs. The script fits a device
lease (limits from the first GPU run's times, what is new first, compiles cached), the checks
print their rows as they finish, and they run the cases the docs say they run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from easy_context.core import kernels
from easy_context.core.backends import band, cpu_flash
from easy_context.core.backends import flex as flex_backend
from tools import check_exactness, check_generate, check_kernels

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


@pytest.mark.timeout(60)
def test_check_kernels_passes_every_cpu_backend():
    rows = check_kernels.check(torch.device("cpu"), torch.bfloat16, 128, 32)
    assert {r["backend"] for r in rows} == set(kernels.available_backends("cpu", torch.bfloat16, 32))
    assert {r["case"] for r in rows} == {"causal", "rectangular", "documents", "window"}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    # the window block is cut into several band tiles (cpu_flash's band path; cuda_efficient's in fp32)
    assert all(r["tiles"] > 1 for r in rows if r["case"] == "window")


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
    assert [r["ok"] for r in rows if r["backend"] == "math"] == [False] * 4
    assert all(r["ok"] for r in rows if r["backend"] != "math")
    monkeypatch.setitem(kernels.BACKENDS, "math", math._replace(forward=bad_forward))
    rows = check_kernels.check(torch.device("cpu"), torch.float32, 128, 32)
    assert [r["lse_relative"] > 5e-4 and not r["ok"] for r in rows if r["backend"] == "math"] == [True] * 4


@pytest.mark.timeout(60)
def test_check_kernels_bounds_the_band_paths_summed_gradients(monkeypatch):
    """The window case's dK / dV: a band path that keeps the last tile's gradient of a key
    instead of the sum over the tiles that reach it fails the fp32 window row, and only it."""

    def overwriting(call_backward, dout, q, k, v, out, lse, scale, window, key_align=1):
        dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
        for rows, keys, w in band.band_tiles(q.shape[2], k.shape[2], window):
            bias = band._bias(rows, keys, w, q, key_align)
            args = (dout, q, out, lse)
            tile = call_backward(*(x[:, :, rows] for x in args[:2]), k[:, :, keys], v[:, :, keys],
                                 *(x[:, :, rows] for x in args[2:]), scale, bias)  # fmt: skip
            dqs.append(tile[0])
            dk[:, :, keys], dv[:, :, keys] = tile[1], tile[2]  # the bug: = instead of +=
        return torch.cat(dqs, dim=2), dk, dv

    rows = check_kernels.check(torch.device("cpu"), torch.float32, 128, 32)
    assert all(r["ok"] for r in rows)
    monkeypatch.setattr(cpu_flash, "band_backward", overwriting)
    rows = check_kernels.check(torch.device("cpu"), torch.float32, 128, 32)
    failed = [(r["backend"], r["case"]) for r in rows if not r["ok"]]
    assert failed == [("cpu_flash", "window")], failed
    row = next(r for r in rows if r["backend"] == "cpu_flash" and r["case"] == "window")
    assert row["errors"]["dk"] > row["bounds"]["dk"] and row["errors"]["dq"] <= row["bounds"]["dq"]


@pytest.mark.timeout(180)
def test_check_kernels_counts_flex_graphs_across_lengths(monkeypatch):
    """flex compiled (Dynamo's eager backend here, as the dry run): every case at two lengths, the
    second compiles nothing; a flex that compiled per length (static shapes) fails that row."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv(flex_backend.FLEX_COMPILE_ENV, "eager")
    # Dynamo's own patch: monkeypatch's undo of a config-module attribute removes the entry
    # (every later flex call then failed: "recompile_limit does not exist")
    limit = torch._dynamo.config.patch(recompile_limit=64)
    limit.__enter__()
    cpu, lengths = torch.device("cpu"), [272, 288]  # each case over one flex block (128) at both
    try:
        torch._dynamo.reset()
        counters.clear()
        rows = check_kernels.graph_counts(cpu, [torch.float32], lengths, 16)
        assert [r["length"] for r in rows] == [None, *lengths]
        assert rows[1]["new"] > 0 and rows[2]["new"] == 0 and all(r["ok"] for r in rows), rows

        def per_length(backend):
            return torch.compile(flex_backend._flex_attend, backend=backend, dynamic=False)

        monkeypatch.setattr(flex_backend, "_compiled_flex", per_length)
        torch._dynamo.reset()
        counters.clear()
        rows = check_kernels.graph_counts(cpu, [torch.float32], lengths, 16)
        assert rows[2]["new"] > 0 and not rows[2]["ok"], rows
    finally:
        limit.__exit__(None, None, None)
        torch._dynamo.reset()


class Stop(BaseException):
    """A check stopped from outside half-way (a section's time limit): no handler catches it."""


def stop_at_call(n: int, call):
    """`call`, raising Stop on its n-th call."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise Stop
        return call(*args, **kwargs)

    return wrapped


@pytest.mark.timeout(60)
def test_check_kernels_prints_each_row_as_it_finishes(monkeypatch, capsys):
    """Stopped during its second case, check_kernels has printed the header and the first
    case's rows: a section killed at its limit keeps them."""
    monkeypatch.setattr(check_kernels, "truth", stop_at_call(2, check_kernels.truth))
    with pytest.raises(Stop):
        check_kernels.main(["--device", "cpu", "--dtypes", "fp32", "--seq-len", "64", "--head-dim", "16"])
    out = capsys.readouterr().out
    assert "kernel backends vs fp64 on cpu" in out
    for backend in kernels.available_backends("cpu", torch.float32, 16):
        assert re.search(rf"^{backend} +float32 +causal .* yes ", out, re.M), out


@pytest.mark.timeout(60)
def test_check_generate_prints_each_row_as_it_finishes(monkeypatch, capsys):
    """Stopped at its second model, check_generate has printed the first model's rows (fp32 and
    bf16, forced along fp32's tokens)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(check_generate, "tiny_config", stop_at_call(2, check_generate.tiny_config))
    try:
        with pytest.raises(Stop):
            check_generate.main(["--prompt-length", "48", "--new-tokens", "4", "--dtypes", "fp32,bf16"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = capsys.readouterr().out
    assert "| llama | fp32 | True |" in out and "| llama | bf16 | forced |" in out, out
    assert out.count("| yes |") == 2, out


@pytest.mark.timeout(90)
def test_check_exactness_prints_each_row_as_it_finishes(monkeypatch, capsys):
    """Stopped in its second variant, check_exactness has printed the first variant's row."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # fmt: skip
        monkeypatch.setenv(name, value)
    argv = ["check_exactness", "--mode", "zigzag_ring_attn", "--seq-length", "64", "--dtypes", "fp32,bf16"]
    monkeypatch.setattr(sys, "argv", argv)
    # fp32 compares once; bf16 first measures the unpatched model's own error: the second call
    monkeypatch.setattr(check_exactness, "errors", stop_at_call(2, check_exactness.errors))
    try:
        with pytest.raises(Stop):
            check_exactness.main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = capsys.readouterr().out
    assert "zigzag_ring_attn on 1 ranks" in out and re.search(r"^fp32 .* yes$", out, re.M), out


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.timeout(1260)
def test_gpu_check_dry_run(tmp_path):
    """Every section passes on CPU (peers: skipped, not installed); one results file."""
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_CACHE")}
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
    masks = section_output(results, "masks")
    for case in ("causal", "window", "documents"):  # timed on CPU; the CUDA backends say why not
        assert f"\nmath            {case}" in masks and f"SKIP cuda_efficient {case}: not usable" in masks
    multirank = section_output(results, "multirank")
    assert "batch_isend_irecv    works" in multirank and "2 ranks over gloo, cpu tensors (exit 0)" in multirank
    assert multirank.count("  yes  (") == 6 and " NO " not in multirank  # 2 ring modes x 3 masks, simulated
    assert "unexercised here: NCCL" in multirank
    assert "| peers | SKIP |" in summary or "| peers | PASS |" in summary
    # the sections' own tables made it into the file
    assert "kernel backends vs fp64 on cpu" in results and "| all_bf16 |" in results
    assert results.count("ok") >= 8
    for name in ("kernels", "softcap", "generate", "modes_p1", "modes_p2", "multirank"):  # their rows say yes / NO
        assert " NO" not in section_output(results, name), name
    # the several-GPU sections, over gloo here: every transfer exact, clean exits, a stuck rank bounded
    assert "| ulysses | all_to_all |" in results and "| ring | one_way_p2p |" in results and "| False |" not in results
    assert results.count("the process group torn down on all 2 ranks") == 2
    assert "rank 1 stuck, --dist-timeout 15 s" in results
    assert f"compile caches: {ROOT}/.cache/inductor, {ROOT}/.cache/triton (" in results
    # the cases the docs name, in the tools that run them
    kernels_out = section_output(results, "kernels")
    assert re.search(r"^cpu_flash +float32 +window .* yes ", kernels_out, re.M) and "8 band tiles" in kernels_out
    assert re.search(r"flex graphs \(Dynamo\) after S=384: [1-9]\d* \(0 new", kernels_out), kernels_out
    assert "gemma2, 256 tokens, sliding window 64 on 1 of 2 layers" in results
    assert all(f"| {m} | bf16 | forced |" in results for m in ("llama", "mistral", "gemma2"))
    compile_out = section_output(results, "compile")
    assert "(mixed precision: no, 1 rank(s), S = 256)" in compile_out and "| compiled |" in compile_out
    assert "### compile: torch logs (TORCH_LOGS=recompiles,graph_breaks" in compile_out


def section_output(results: str, name: str) -> str:
    """A section's part of the results file: its output and the logs it keeps beside it."""
    return results.split(f"\n## {name}: ", 1)[1].split("\n## ", 1)[0]


SECTIONS = (
    "env", "toolchain", "kernels", "softcap", "generate", "compile", "masks", "bench", "train", "modes_p1",
    "modes_p2", "collectives_p2", "multirank", "exit_p2", "timeout_p2", "two_gpu",
)  # fmt: skip
LEASE_S = 15 * 60  # one device lease, every start and idle minute counted
START_S = 150  # a machine's start ("a minute or more"; assumed), the transfers included
DEADLINE_RE = r'DEADLINE=\$\{DEADLINE:-\$\(\[ "\$DRY_RUN" = 1 \] && echo (\d+) \|\| echo (\d+)\)\}'


def section_limits(script: str) -> list[tuple[str, int, int]]:
    """(name, GPU limit, dry-run limit) of every section call, in the order they run."""
    return [
        (name, int(gpu), int(dry))
        for name, gpu, dry in re.findall(r'^\s*section "?([\w$]+)"? "\$\(limit (\d+) (\d+)\)"', script, re.M)
    ]


def branches(script: str) -> tuple[str, str]:
    """The dry run's arguments and the CUDA ones (the script's `if DRY_RUN ... else ... fi`)."""
    body = script.split('\nif [ "$DRY_RUN" = 1 ]; then\n', 1)[1].split("\nfi\n", 1)[0]
    dry, gpu = body.split("\nelse\n", 1)
    return dry, gpu


def first_run_table(script: str) -> dict:
    """The header's table: section -> (seconds on the first H200 run, limit, what changed since)."""
    rows = re.findall(r"^#   (\w+) +(\d+) +(\d+) +(\S.*)$", script, re.M)
    return {name: (int(first), int(limit), note) for name, first, limit, note in rows}


def test_gpu_check_budget_fits_its_deadlines():
    """Every section has a limit on a GPU and in the dry run, and each column adds up to at most
    its default deadline (520 s on one GPU: the device allows 600 s per command; 1200 s on CPU),
    so no section is cut short by the ones before it. On several GPUs, the sections the two_gpu
    line names for `--only` fit the same 520 s."""
    script = SCRIPT.read_text()
    limits = section_limits(script)
    assert {name.replace("$MULTI", "2") for name, _, _ in limits} == {*SECTIONS, "peers"}, limits
    deadlines = re.search(DEADLINE_RE, script)
    dry_deadline, gpu_deadline = int(deadlines[1]), int(deadlines[2])
    one_gpu = [gpu for name, gpu, _ in limits if "$MULTI" not in name]  # _pN: several GPUs only
    assert gpu_deadline == 520 and sum(one_gpu) <= gpu_deadline, limits
    assert sum(dry for _, _, dry in limits) <= dry_deadline, limits
    several = re.search(r'SEVERAL_GPUS_ONLY="([\w,]+)"', script)[1].split(",")  # the default on several GPUs
    chosen = [gpu for name, gpu, _ in limits if name.replace("_p$MULTI", "").replace("_p1", "") in several]
    assert {"modes", "collectives", "exit", "timeout"} <= set(several) and sum(chosen) <= gpu_deadline, chosen


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_gpu_check_limits_come_from_the_first_run_and_fit_a_lease():
    """The header's table gives each one-GPU section the first H200 run's time and its limit,
    and the calls use those limits. Sections whose code has not changed since that run are
    trimmed (a limit below its time then); the others say what changed. The limits add up to
    at most the deadline, one command (600 s) holds the deadline, and a lease holds a machine's
    start, the whole run and one rerun of its longest section, within 12 minutes of commands."""
    script = SCRIPT.read_text()
    table = first_run_table(script)
    one_gpu = {name: gpu for name, gpu, _ in section_limits(script) if "$MULTI" not in name}
    assert set(table) == set(one_gpu), (sorted(table), sorted(one_gpu))
    assert {name: limit for name, (_, limit, _) in table.items()} == one_gpu
    for name, (first, limit, note) in table.items():
        assert note.split(":")[0].split()[0] in ("new", "changed", "unchanged"), (name, note)
        if note.startswith("unchanged: trimmed"):
            assert limit < first, (name, first, limit)
    trimmed = {name for name, (_, _, note) in table.items() if note.startswith("unchanged: trimmed")}
    assert {"modes_p1", "multirank"} <= trimmed, trimmed
    gpu = branches(script)[1]  # the CUDA arguments: the trimmed sections do less than on the first run
    assert re.search(r"^ *MODES_P1_DTYPES=bf16\b", gpu, re.M), gpu
    assert re.search(r'^ *MULTIRANK_ARGS="[^"]*--dtypes fp32 [^"]*--gloo-runs 0"', gpu, re.M), gpu
    deadline = int(re.search(DEADLINE_RE, script)[2])
    longest = max(one_gpu.values())
    assert sum(one_gpu.values()) <= deadline <= 600, (sum(one_gpu.values()), deadline)
    assert START_S + deadline + longest <= LEASE_S - 60 and deadline + longest <= 12 * 60, (deadline, longest)


def test_gpu_check_runs_what_is_new_first():
    """env and toolchain (what every later section needs), then the sections no GPU has run in
    their present form, then those that changed since the first run, then the unchanged ones."""
    script = SCRIPT.read_text()
    order = [name.replace("$MULTI", "2") for name, _, _ in section_limits(script)]
    table = first_run_table(script)
    kind = {name: note.split(":")[0].split()[0] for name, (_, _, note) in table.items()}
    assert order[:2] == ["env", "toolchain"] and kind["env"] == kind["toolchain"] == "unchanged"
    one_gpu = [name for name in order[2:] if name in kind]
    ranks = [("new", "changed", "unchanged").index(kind[name]) for name in one_gpu]
    assert ranks == sorted(ranks), list(zip(one_gpu, ranks))
    assert one_gpu[:4] == ["kernels", "softcap", "generate", "compile"], one_gpu


def test_gpu_check_caches_compiles_in_an_ignored_folder():
    """Inductor's and Triton's caches live in the repository's .cache/, which git ignores: a
    warm device machine keeps them between calls (a rerun loads what the first run compiled).
    The dry run's env section says where they are, and warm or cold (test_gpu_check_dry_run)."""
    script = SCRIPT.read_text()
    assert re.search(r"^CACHE_DIR=\$\{GPU_CHECK_CACHE:-\$REPO/\.cache\}$", script, re.M), "no cache folder"
    assert 'export TORCHINDUCTOR_CACHE_DIR="$CACHE_DIR/inductor" TRITON_CACHE_DIR="$CACHE_DIR/triton"' in script
    assert "export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1" in script
    ignored = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()]
    assert {"/.cache/", ".cache/", "/.cache", ".cache"} & set(ignored), "git does not ignore .cache/"


def test_gpu_check_names_the_new_cases_in_their_tools():
    """softcap with a window shorter than S (check_exactness --sliding-window), the window case
    and the graph counts at two lengths in check_kernels, bf16 decoding in check_generate, and
    an instrumented compile section: on the GPU and in the dry run alike."""
    script = SCRIPT.read_text()
    for branch in branches(script):
        softcap = re.search(r'SOFTCAP_ARGS="--seq-length (\d+) --sliding-window (\d+)"', branch)
        assert softcap and int(softcap[2]) < int(softcap[1]), branch
        seq = int(re.search(r'KERNEL_ARGS="[^"]*--seq-len (\d+)', branch)[1])
        lengths = [int(n) for n in re.search(r'KERNEL_ARGS="[^"]*--graph-lengths (\d+),(\d+)"', branch).groups()]
        assert lengths[0] != lengths[1] and min(lengths) // 2 > 128, lengths  # every case over one flex block
        window_seq = check_kernels.window_length(seq)  # several band tiles at this length
        assert len(band.band_tiles(window_seq, window_seq, check_kernels.window_of(window_seq))) > 1
        assert re.search(r'GENERATE_ARGS="[^"]*--dtypes fp32,bf16"', branch), branch
        compile_len = int(re.search(r"COMPILE_LEN=(\d+)", branch)[1])
        assert compile_len < int(re.search(r"TRAIN_LEN=(\d+)", branch)[1]) and compile_len <= 1024
    assert re.search(r"softcap_exact\(\) \{[^}]*check_exactness[^}]*\$SOFTCAP_ARGS", script)
    compile_train = script.split("compile_train() {", 1)[1].split("\n}\n", 1)[0]
    assert "TRAIN_RANKS=1" in compile_train and "TORCH_LOGS_OUT=" in compile_train and "DUMP_AFTER=" in compile_train
    assert re.search(r'TORCH_LOG_KINDS="recompiles,graph_breaks', script)
    variant = script.split("train_variant() {", 1)[1].split("\n}\n", 1)[0]
    assert "-X faulthandler" in variant and "dump_traceback_later" in variant and 'if [ "$nproc" = 1 ]' in variant


def runner_block(script: str) -> str:
    """The script's section runner (section, run_limited, flex_compile_failure, json_row), to
    run on its own with stand-in sections."""
    begin = "# --- the section runner (tests/recipes/test_gpu_check.py runs this block on its own) ---\n"
    return script.split(begin, 1)[1].split("# --- the section runner: end ---", 1)[0]


def run_sections(tmp_path, calls: str) -> subprocess.CompletedProcess:
    harness = "\n".join(
        [
            "set -uo pipefail",
            f"DEADLINE=300 RESULTS={tmp_path}/results.md JSONL={tmp_path}/rows.jsonl",
            f"export WORK={tmp_path}",
            "ONLY= FAILED=0 TORCH_LOG_KINDS= SUMMARY=()",
            runner_block(SCRIPT.read_text()),
            calls,
            'printf "%s\\n" "${SUMMARY[@]}"',
        ]
    )
    return subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_a_section_that_fails_to_compile_flex_reruns_once_with_flex_eager(tmp_path):
    """A section whose log shows flex failing to compile runs once more with
    EASY_CONTEXT_FLEX_COMPILE=off, and its verdict, its JSON line and the results file say so;
    one that fails for another reason (or fails again eager) is not rerun (again)."""
    calls = """
compiles_badly() {  # flex fails to compile unless it runs eager
  echo "run $EASY_CONTEXT_FLEX_COMPILE" >> "$WORK/calls"
  if [ "$EASY_CONTEXT_FLEX_COMPILE" = off ]; then echo "flex  float32  causal  yes"; return 0; fi
  echo "flex  float32  causal  FAILED: BackendCompilerFailed: backend='inductor' raised: CompilationError"
  return 1
}
always_broken() { echo "run $EASY_CONTEXT_FLEX_COMPILE" >> "$WORK/calls"; echo "InductorError in flex.py"; return 1; }
wrong() { echo "flex  float32  causal  FAILED: RuntimeError: a wrong number"; return 1; }
export -f compiles_badly always_broken wrong
export EASY_CONTEXT_FLEX_COMPILE=inductor
section kernels 30 compiles_badly
section softcap 30 always_broken
section masks 30 wrong
"""
    run = run_sections(tmp_path, calls)
    summary = run.stdout
    assert "| kernels | PASS (flex eager: its compile failed) |" in summary, run.stdout + run.stderr
    assert "| softcap | FAIL (exit 1) (flex eager: its compile failed) |" in summary, summary
    assert "| masks | FAIL (exit 1) |" in summary, summary
    assert (tmp_path / "calls").read_text().split("\n")[:4] == ["run inductor", "run off", "run inductor", "run off"]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["section"] for r in rows] == ["kernels", "softcap", "masks"]
    assert rows[0]["flex_compile"].startswith("off: compiled flex failed (flex  float32  causal  FAILED: Backend")
    assert rows[0]["result"] == "PASS (flex eager: its compile failed)" and rows[2]["flex_compile"] == "compiled"
    results = (tmp_path / "results.md").read_text()
    assert "### kernels: the run with flex compiled, which failed to compile" in results
    assert "flex: off: compiled flex failed" in section_output(results, "kernels")


@pytest.mark.slow
def test_train_compares_each_variant_as_soon_as_it_has_run(tmp_path):
    """train_options compares plain with each variant right after it (a section stopped at its
    limit keeps the comparisons so far), then all of them together."""
    script = SCRIPT.read_text()
    body = "train_options() {" + script.split("train_options() {", 1)[1].split("\n}\n", 1)[0] + "\n}\n"
    harness = (
        body
        + """
train_variant() { echo "ran $1"; }
compare_losses() { echo "compare $*"; }
train_options
"""
    )
    run = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=30)
    assert run.stdout.splitlines() == [
        "ran plain", "ran all", "compare plain all", "ran all_bf16", "compare plain all_bf16",
        "-- every variant against plain", "compare plain all all_bf16",
    ], run.stdout + run.stderr  # fmt: skip


@pytest.mark.timeout(120)
def test_check_kernels_counts_flex_graphs_before_the_table(monkeypatch, capsys):
    """The graph counts do the compiling, so they come first: stopped at the table's first case,
    check_kernels has printed both lengths' counts."""
    monkeypatch.setenv(flex_backend.FLEX_COMPILE_ENV, "eager")
    monkeypatch.setattr(check_kernels, "check", stop_at_call(1, check_kernels.check))
    limit = torch._dynamo.config.patch(recompile_limit=64)
    limit.__enter__()
    try:
        torch._dynamo.reset()
        with pytest.raises(Stop):
            check_kernels.main(["--device", "cpu", "--dtypes", "fp32", "--seq-len", "64", "--head-dim", "16",
                                "--graph-lengths", "272,288"])  # fmt: skip
    finally:
        limit.__exit__(None, None, None)
        torch._dynamo.reset()
    out = capsys.readouterr().out
    assert re.search(r"flex graphs \(Dynamo\) after S=288: \d+ \(0 new", out), out
