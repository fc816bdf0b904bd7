"""Many nodes without starting any: the launcher's ranks per node, usp_attn's default split
(Ulysses inside a node up to what the heads allow, the ring across nodes), its plumbing through
the context, and the planner's two link speeds. (The run on two simulated nodes:
tests/recipes/test_many_nodes.py.)"""

import dataclasses

import pytest

from easy_context.core import collectives
from easy_context.core.groups import NODE_SIZE_VARIABLES, Placement, ranks_per_node
from easy_context.hf.context import SequenceParallel
from easy_context.hf.heads import model_heads, placement_of
from easy_context.modes import BUILT_MODES, get_mode
from recipes import plan as P


@pytest.fixture
def no_launcher(monkeypatch):
    for name in NODE_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_ranks_per_node_reads_each_launchers_variable_in_order():
    assert ranks_per_node({}) is None
    assert ranks_per_node({"LOCAL_WORLD_SIZE": "4"}) == 4  # torchrun, accelerate launch
    assert ranks_per_node({"LOCAL_SIZE": "8"}) == 8  # the DeepSpeed launcher
    assert ranks_per_node({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2  # Open MPI
    assert ranks_per_node({"SLURM_NTASKS_PER_NODE": "4"}) is None  # inherited by every process of a job
    assert ranks_per_node({"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "8"}) == 2
    assert ranks_per_node({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "8"}) == 8
    for bad in ("0", "four", "-2", "4(x2)"):
        with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=.*number of ranks per node"):
            ranks_per_node({"LOCAL_WORLD_SIZE": bad})


@pytest.mark.parametrize(
    "world, node, heads, kv_heads, ring",
    [
        (4, 2, 4, 2, 2),  # the simulated 2 x 2 of test_many_nodes: Ulysses 2 in a node, ring 2 across
        (16, 8, 32, 8, 2),  # Llama-3-8B on 2 nodes of 8
        (16, 8, 32, 2, 8),  # 2 KV heads: Ulysses 2, the ring over the rest
        (4, 2, 4, 1, 4),  # one KV head: all ring
        (4, 2, 3, 3, 4),  # 3 heads do not split over 2: all ring
        (12, 6, 12, 4, 6),  # SP of 12 over nodes of 6, 4 KV heads: Ulysses 2
        (32, 8, 64, 8, 4),  # 4 nodes
        (4, 4, 4, 4, 1),  # one node: pure Ulysses, as before
        (8, 8, 2, 2, 1),  # one node, even where the heads do not split (Ulysses refuses that itself)
        (8, None, 8, 8, 1),  # no launcher said: one node
        (4, 3, 4, 4, 1),  # 3 per node do not fill nodes of a world of 4: treated as one node
        (16, 32, 8, 8, 1),  # more per node than the world: one node
    ],
)
def test_usp_default_follows_nodes_and_heads(world, node, heads, kv_heads, ring):
    topology = get_mode("usp_attn").topology(world, None, None, Placement(node, heads, kv_heads))
    assert topology.ring_degree == ring
    u = topology.ulysses_degree
    if ring > 1:  # node-aligned: consecutive Ulysses groups that never cross a node boundary
        assert node % u == 0 and heads % u == 0 and kv_heads % u == 0


def test_usp_default_for_sp_groups_smaller_than_the_world():
    usp = get_mode("usp_attn")
    # SP groups of 4 on nodes of 8: each group on one node
    assert usp.topology(16, 4, None, Placement(8, 32, 8)).ring_degree == 1
    # SP groups of 4 on nodes of 6 (world 12): ranks 4..7 cross a node; Ulysses 2 keeps its pairs on one
    assert usp.topology(12, 4, None, Placement(6, 32, 8)).ring_degree == 2
    # SP groups of 16 on nodes of 8 with dp 2
    assert usp.topology(32, 16, None, Placement(8, 32, 8)).ring_degree == 2


def test_an_explicit_ring_degree_overrides_and_other_modes_ignore_nodes():
    usp = get_mode("usp_attn")
    assert usp.topology(16, None, 16, Placement(8, 32, 8)).ring_degree == 16
    assert usp.topology(16, None, 1, Placement(8, 32, 8)).ring_degree == 1
    for name in BUILT_MODES:
        mode = get_mode(name)
        if not mode.takes_ring_degree:
            assert mode.topology(16, None, None, Placement(8, 32, 8)) == mode.topology(16)


def test_placement_rejects_what_is_not_a_count():
    with pytest.raises(ValueError, match="ranks_per_node=0"):
        Placement(0)
    with pytest.raises(ValueError, match="kv_heads=2.5"):
        Placement(8, 32, 2.5)


def test_the_context_derives_the_split_from_the_launcher_and_the_models_heads(no_launcher):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained("configs/tiny-llama")  # 4 heads, 2 KV heads
    assert model_heads(config) == (4, 2) and model_heads("llama") == (None, None)
    no_launcher.setattr(collectives, "world_size", lambda: 4)
    context = SequenceParallel("usp_attn", heads=model_heads(config))
    assert context.topology().ring_degree == 1  # no launcher variable: one node
    no_launcher.setenv("LOCAL_WORLD_SIZE", "2")
    assert placement_of(config) == Placement(2, 4, 2)
    assert context.topology().ring_degree == 2
    assert context.with_options("test", {"document_split": True}).topology().ring_degree == 2
    assert context.with_options("test", {"ring_degree": 4}).topology().ring_degree == 4
    # a topology asked about for another world size does not apply this world's nodes
    assert placement_of(config, 8) == Placement(None, 4, 2)
    assert context.topology(8).ring_degree == 1
    # the layout that shard() cuts follows the same split
    layout = context.layout()
    assert (layout.ring_degree, layout.ulysses_degree) == (2, 2)


def test_planner_prices_links_inside_and_across_nodes():
    model = P.load_model("llama-3-8b")
    seq, gpus = 65536, 16
    one_node = P.get_device("h100-80g", per_node=16)
    two_nodes = P.get_device("h100-80g", per_node=8)
    assert (two_nodes.link_gbs, two_nodes.network_gbs) == (450.0, 50.0)
    ratio = two_nodes.link_gbs / two_nodes.network_gbs

    def times(mode, ring, device):
        t = P.throughput(model, seq, gpus, P.Options(mode, 16, ring), device)
        return t["t_a2a"], t["t_ring"]

    # pure Ulysses over 16: its all-to-all crosses the network on two nodes
    a2a_one, _ = times("ulysses_attn", 1, one_node)
    a2a_two, _ = times("ulysses_attn", 1, two_nodes)
    assert a2a_two == pytest.approx(a2a_one * ratio)
    # usp with Ulysses 8 inside each node: the all-to-all stays on the node's links, the ring crosses
    a2a_one, ring_one = times("usp_attn", 2, one_node)
    a2a_two, ring_two = times("usp_attn", 2, two_nodes)
    assert a2a_two == pytest.approx(a2a_one) and ring_two == pytest.approx(ring_one * ratio)
    # Ulysses 16 over nodes of 8 is slower than usp's split in the ranking; on one node of 16 it is not priced so
    rows = P.plan(
        model, seq, gpus, two_nodes, sp_sizes=[16], modes=["usp_attn", "ulysses_attn"], zero_choices=["zero3"]
    )
    best = {}
    for row in rows["rows"]:
        best.setdefault((row["mode"], row["ring_degree"]), row["tokens_per_s"])
    assert best[("usp_attn", 2)] > best[("ulysses_attn", 1)]
    rows_one = P.plan(model, seq, gpus, one_node, sp_sizes=[16], modes=["ulysses_attn"], zero_choices=["zero3"])
    assert rows_one["rows"][0]["tokens_per_s"] > best[("ulysses_attn", 1)]


def test_planner_flags_override_the_device(capsys):
    device = P.get_device("a100-80g", per_node=4, link_gbs=100, network_gbs=12.5)
    assert dataclasses.astuple(device)[3:5] == (100, 12.5) and device.per_node == 4
    args = ["--model", "llama-3-8b", "--seq-length", "65536", "--gpus", "16", "--gpus-per-node", "8", "--top", "3"]
    assert P.main([*args, "--network-gbs", "25"]) == 0
    assert "2 nodes of 8: 450 GB/s per device inside a node, 25 GB/s across nodes" in capsys.readouterr().out
    for flag, value in (("--gpus-per-node", "0"), ("--link-gbs", "-1"), ("--network-gbs", "0")):
        assert P.main([*args, flag, value]) == 2
        assert f"{flag} must be positive, got" in capsys.readouterr().err


def _split_with_node_size(rank, world, node_sizes):
    import os

    from easy_context.core.groups import get_groups

    os.environ["LOCAL_WORLD_SIZE"] = str(node_sizes[rank])
    context = SequenceParallel("usp_attn", heads=(4, 2))
    try:
        get_groups(context.topology())
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_that_derive_different_splits_are_refused_on_every_rank():
    from ranks import run_ranks

    # rank 0 believes in nodes of 1 (usp: all ring), rank 1 in one node of 2 (usp: all Ulysses)
    errors = run_ranks(_split_with_node_size, 2, (1, 2))
    for error in errors:
        assert error is not None and "ranks disagree on the split of the SP group" in error, errors
        assert "rank 0 has (2, 2), rank 1 has (2, 1)" in error, error
