"""Two nodes simulated on one machine: two torchrun agents (--nnodes 2, --node_rank 0/1, two
processes each) on 127.0.0.1 run train.py under usp_attn without --ring-degree. The default
split must follow the nodes (Ulysses over the two ranks of a node, the ring across the nodes)
and the run must be exact against one process."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from script_runs import ROOT, SMALL, train

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

STEPS = ["--max-train-steps", "3", "--gradient-accumulate-every", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(out, *flags, timeout=300):
    """Both agents' (return code, stderr); their ranks write into `out` (rank 0 logs and saves)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EASY_CONTEXT_LOG_GROUPS": "1"}
    agents = []
    for node in (0, 1):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(node),
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(ROOT / "train.py"),
            "--output-dir",
            str(out),
            *SMALL,
            "--from-scratch",  # as test_train.train's reference run
            *flags,
        ]
        agents.append(
            subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        )
    try:
        return [(agent.wait(timeout=timeout), agent.stderr.read()) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


@pytest.mark.timeout(420)
def test_two_simulated_nodes_split_usp_by_node_and_train_exactly(tmp_path):
    want, single = train(tmp_path, "one", 1, "--parallel-mode", "data_parallel", *STEPS)
    out = tmp_path / "nodes"
    results = two_nodes(out, "--parallel-mode", "usp_attn", *STEPS)
    for code, stderr in results:
        assert code == 0, stderr[-3000:]

    logged = {}
    pattern = r"easy_context groups: rank (\d) node (\d) sp=(\[.*?\]) ulysses=(\[.*?\]) ring=(\[.*?\])"
    for _, stderr in results:
        for match in re.finditer(pattern, stderr):  # not line by line: other output may share a line
            rank, node, *lists = match.groups()
            logged[int(rank)] = (int(node), *(eval(x) for x in lists))  # noqa: S307 (lists we printed)
    assert sorted(logged) == [0, 1, 2, 3], logged
    node_of = {rank: node for rank, (node, *_) in logged.items()}
    assert node_of == {0: 0, 1: 0, 2: 1, 3: 1}
    for rank, (node, sp, ulysses, ring) in logged.items():
        assert sp == [0, 1, 2, 3]
        assert len(ulysses) == 2 and {node_of[r] for r in ulysses} == {node}, (rank, ulysses)  # inside the node
        assert len(ring) == 2 and {node_of[r] for r in ring} == {0, 1}, (rank, ring)  # across the nodes

    got = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    mine, reference = load_file(out / "model.safetensors"), load_file(single / "model.safetensors")
    assert mine.keys() == reference.keys()
    worst = max((mine[k] - reference[k]).abs().max().item() for k in reference)
    assert worst <= 1e-5, worst
    assert all(torch.equal(mine[k].isfinite(), reference[k].isfinite()) for k in reference)
