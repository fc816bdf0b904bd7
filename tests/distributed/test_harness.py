"""eval_harness.py's model `easy_context` (recipes/lm_eval_model.py) against lm-eval's own `hf` model on
the shipped base (a real BPE tokenizer), at 2 gloo ranks: every per-request loglikelihood within
fp32 noise and the same greedy flags, rolling loglikelihoods over several windows, and the same
greedy generations, in every mode; lm-eval's rank and gathers are the data-parallel groups'.
And the command line end to end: an ec_ruler task under torchrun writes lm-eval's results and
samples, with the answers of `--model hf`. lm-eval is in pyproject's test extra: imported by the
ranks and scripts, so a missing lm-eval fails these tests (the floors' fast tier never runs them)."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import run_ranks

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "models" / "demo-base")
MAX_LENGTH = 512  # the base's context; one request and the rolling text are longer (truncated, windows)
MODES = [
    ("zigzag_ring_attn", {}),
    ("dist_flash_attn", {}),
    ("ulysses_attn", {}),
    ("usp_attn", {"ring_degree": 2}),
    ("data_parallel", {}),
]


def _requests():
    from lm_eval.api.instance import Instance

    from recipes.data import embedded_prose

    text = " ".join(embedded_prose().split())
    pairs = [
        (text[:1200], " the"),
        (text[2000:3000], text[3000:3060]),
        ("", "Hello world"),  # empty context: lm-eval's prefix token
        (text[4000:7000], text[7000:7030]),  # longer than MAX_LENGTH: the last tokens kept
    ]
    scored = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    rolling = [Instance("loglikelihood_rolling", {}, (text[8000:11000],), 0)]
    options = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    generated = [Instance("generate_until", {}, (text[i : i + 900] + " The", options), i) for i in (0, 5000)]
    return scored, rolling, generated


def _worker(rank, world):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import easy_context as ec
    from recipes.lm_eval_model import SeqParallelLM

    scored, rolling, generated = _requests()
    reference = HFLM(
        pretrained=AutoModelForCausalLM.from_pretrained(DEMO),
        tokenizer=AutoTokenizer.from_pretrained(DEMO),
        max_length=MAX_LENGTH,
        batch_size=2,
    )

    def answers(lm):
        return [lm.loglikelihood(scored), lm.loglikelihood_rolling(rolling), lm.generate_until(generated)]

    want, results = answers(reference), {}
    for mode, options in MODES:
        lm = SeqParallelLM(pretrained=DEMO, mode=mode, max_length=MAX_LENGTH, **options)
        got = answers(lm)
        groups = (lm.rank, lm.world_size, lm.all_gather(torch.tensor(rank)).tolist(), lm.gather_object(rank))
        results[mode] = (got, groups)
        ec.remove_seq_parallel_monkey_patch()
    return want, results


@pytest.mark.timeout(400)
def test_backend_matches_lm_evals_hf_model_in_every_mode():
    per_rank = run_ranks(_worker, 2, timeout=380)
    for rank, (want, results) in enumerate(per_rank):
        (want_scored, want_rolling, want_text) = want
        assert len(want_rolling) == 1 and len(want_text) == 2 and all(want_text), want_text
        for mode, ((scored, rolling, text), groups) in results.items():
            for (logprob, greedy), (want_logprob, want_greedy) in zip(scored, want_scored):
                assert logprob == pytest.approx(want_logprob, rel=1e-5, abs=1e-4), (mode, scored, want_scored)
                assert greedy == want_greedy, (mode, scored, want_scored)
            assert rolling == pytest.approx(want_rolling, rel=1e-5), (mode, rolling, want_rolling)
            assert text == want_text, (mode, text, want_text)
            # lm-eval splits requests by data-parallel group and keeps one copy of each group's results
            expected = (rank, 2, [0, 1], [0, 1]) if mode == "data_parallel" else (0, 1, [0], [0])  # SP rank 0 speaks
            assert groups == expected, (mode, groups)


def _groups_worker(rank, world):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from recipes.lm_eval_model import SeqParallelLM

    scored, _, _ = _requests()
    lm = SeqParallelLM(pretrained=DEMO, mode="ulysses_attn", sp_size=2, max_length=MAX_LENGTH)
    return (
        lm.rank,
        lm.world_size,
        lm.all_gather(torch.tensor([rank, rank])).tolist(),
        lm.gather_object(rank),
        (lm.loglikelihood(scored[:2])),
    )


@pytest.mark.timeout(200)
def test_lm_eval_sees_the_data_parallel_groups():
    """World 4 as 2 groups x sp 2: lm-eval's rank and world size are the group's, its gathers hold
    one copy per group (SP rank 0's), and both ranks of a group score alike."""
    per_rank = run_ranks(_groups_worker, 4, timeout=180)
    for rank, (dp_rank, dp_size, gathered, objects, scored) in enumerate(per_rank):
        assert (dp_rank, dp_size, gathered, objects) == (rank // 2, 2, [0, 0, 2, 2], [0, 2]), rank
        assert scored == per_rank[rank - rank % 2][4]


@pytest.mark.timeout(300)
def test_command_line_runs_a_task_end_to_end_like_hf(tmp_path):
    """torchrun eval_harness.py --model easy_context: lm-eval's results and samples files, with
    the answers lm-eval's own hf model gives to the same prompts in this process."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "eval_harness.py",
        "--model", "easy_context", "--model_args", f"pretrained={DEMO},mode=ulysses_attn",
        "--tasks", "ec_ruler_niah_single_1", "--metadata", '{"max_seq_lengths": [512], "num_samples": 2}',
        "--log_samples", "--output_path", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    (results,) = glob.glob(f"{tmp_path}/**/results_*.json", recursive=True)
    assert json.loads(Path(results).read_text())["results"]["ec_ruler_niah_single_1"]["512,none"] >= 0
    (samples,) = glob.glob(f"{tmp_path}/**/samples_ec_ruler_niah_single_1_*.jsonl", recursive=True)
    samples = [json.loads(line) for line in Path(samples).read_text().splitlines()]
    assert len(samples) == 2
    hf = HFLM(pretrained=DEMO, device="cpu", batch_size=1)
    requests = [Instance("generate_until", {}, tuple(s["arguments"]["gen_args_0"].values()), 0) for s in samples]
    assert [s["resps"][0][0] for s in samples] == hf.generate_until(requests)
