"""prepare_trainer: HF Trainer and TRL SFTTrainer under every mode train exactly like the
unpatched single-process Trainer on the same data and seed (per-step losses, eval loss,
final weights, predict() logits), with padded and packed collators, gradient accumulation 2, data-parallel
groups (world 4, sp_size 2; rows dealt to them by attention work) and resume from a mid-run checkpoint.

fp32 tolerances: losses and eval loss 1e-5, weights and logits 1e-6 (measured: at most 9.5e-7,
and 3.5e-7 for weights and the logits of real tokens).
The runs use SGD (lr 0.5) so that a weight difference is a gradient difference times lr;
Adam would turn last-bit differences of near-zero gradients into steps of up to its lr.
"""

import functools
import tempfile

import pytest
import torch
from ranks import run_ranks
from tiny_models import tiny_model
from trainer_runs import BYTE_LLAMA, misuse, train, train_and_resume

import easy_context as ec

STEPS = 3
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-6
BASE = dict(batch=2, accumulate=2, steps=STEPS)


@functools.cache
def _reference(collator: str, batch: int, sft: bool = False, bf16: bool = False, balance_work: bool = False) -> dict:
    """The unpatched Trainer in one process. batch 4 stands for two data-parallel groups of
    batch 2 (in training and, token-weighted as the Trainer weighs them, in evaluation)."""
    with tempfile.TemporaryDirectory() as out:
        spec = dict(BASE, mode=None, collator=collator, batch=batch, eval_batch=batch, out=out, sft=sft, bf16=bf16)
        spec["balance_work"] = balance_work
        return run_ranks(train, 1, spec, timeout=240)[0]


def _differences(result: dict, reference: dict) -> tuple[float, float, float]:
    """(per-step loss, eval loss, weights and predict() logits): largest absolute differences."""
    assert len(result["losses"]) == len(reference["losses"]) > 0, (result["losses"], reference["losses"])
    loss = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"]))
    eval_loss = abs(result["eval_loss"] - reference["eval_loss"])
    weights = max((result["weights"][k] - w).abs().max().item() for k, w in reference["weights"].items())
    assert result["predictions"].shape == reference["predictions"].shape
    weights = max(weights, (result["predictions"] - reference["predictions"]).abs().max().item())
    return loss, eval_loss, weights


def _assert_exact(results: list, reference: dict) -> None:
    for rank, result in enumerate(results):
        loss, eval_loss, weights = _differences(result, reference)
        print(f"DIFFERENCES rank {rank}: loss {loss:.1e} eval {eval_loss:.1e} weights/logits {weights:.1e}")
        assert loss <= LOSS_TOL and eval_loss <= LOSS_TOL and weights <= WEIGHT_TOL, (
            f"rank {rank}: loss diff {loss:.2e}, eval loss diff {eval_loss:.2e}, weight/logit diff {weights:.2e}; "
            f"losses {result['losses']} vs {reference['losses']}"
        )


def _run(world: int, mode: str, collator: str, timeout: float = 240, **spec) -> list:
    with tempfile.TemporaryDirectory() as out:
        return run_ranks(train, world, dict(BASE, mode=mode, collator=collator, out=out, **spec), timeout=timeout)


MODES = [
    ("zigzag_ring_attn", {}),
    ("dist_flash_attn", {}),
    ("ulysses_attn", {}),
    ("usp_attn", {"ring_degree": 2}),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("collator", ["padded", "packed"])
@pytest.mark.parametrize("mode,options", MODES, ids=[m for m, _ in MODES])
def test_trainer_matches_single_process(mode, options, collator):
    """P=2; row lengths that no layout divides (padded internally); GA 2; eval loss."""
    _assert_exact(_run(2, mode, collator, options=options), _reference(collator, batch=2))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "mode,collator,options,reference_batch,balance_work",
    [
        # 2 data-parallel groups of 2, each step's rows dealt by attention work (balance_work):
        # the reference reads both groups' batches of the same order
        ("zigzag_ring_attn", "padded", {"sp_size": 2}, 4, True),
        ("usp_attn", "packed", {"sp_size": 4, "ring_degree": 2}, 2, False),  # Ulysses x ring over 4 ranks
    ],
    ids=["dp2-sp2-zigzag-work-balanced", "sp4-usp"],
)
def test_trainer_world_4(mode, collator, options, reference_batch, balance_work):
    results = _run(4, mode, collator, timeout=360, options=options, balance_work=balance_work)
    _assert_exact(results, _reference(collator, batch=reference_batch, balance_work=balance_work))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_left_padding_and_document_split():
    """Left-padded rows, and packed rows under document_split (a layout per row: every document
    cut, and documents whole with the longest cut)."""
    _assert_exact(_run(2, "zigzag_ring_attn", "left-padded"), _reference("left-padded", batch=2))
    _assert_exact(_run(2, "dist_flash_attn", "packed", options={"document_split": True}), _reference("packed", batch=2))
    workload = _run(2, "zigzag_ring_attn", "packed", options={"document_split": "workload"})
    _assert_exact(workload, _reference("packed", batch=2))


GRANITE_4_H = dict(layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3, position_embedding_type="nope")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_trainer_trains_a_hybrid_like_one_process():
    """Qwen3-Next (Gated DeltaNet layers and attention) under the Trainer: right-padded rows, the
    mixers by state passing; and Granite 4.0-H (Mamba-2 and attention) under Ulysses. (Packed rows
    differ from one process by design: its torch path carries the state across documents, ours
    restarts it; tests/distributed/test_hybrids.py compares packed rows against each document
    alone.)"""
    spec = dict(model_type="qwen3_next", options={"mixer_strategy": "state_passing"})
    with tempfile.TemporaryDirectory() as out:
        reference = run_ranks(
            train, 1, dict(BASE, mode=None, collator="padded", out=out, model_type="qwen3_next"), timeout=240
        )[0]
    _assert_exact(_run(2, "zigzag_ring_attn", "padded", **spec), reference)
    # Granite 4.0-H: attention among Mamba-2 layers, no positions passed to them (issue 56)
    granite = dict(model_type="granitemoehybrid", config=GRANITE_4_H)
    with tempfile.TemporaryDirectory() as out:
        reference = run_ranks(train, 1, dict(BASE, mode=None, collator="padded", out=out, **granite), timeout=240)[0]
    _assert_exact(_run(2, "ulysses_attn", "padded", **granite), reference)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_resume_from_checkpoint():
    """save_steps=2, then a new Trainer resumes from checkpoint-2: the same step-3 loss and
    final weights as the single-process run without interruption."""
    with tempfile.TemporaryDirectory() as out:
        spec = dict(BASE, mode="zigzag_ring_attn", collator="padded", out=out, save_steps=2)
        results = run_ranks(train_and_resume, 2, spec, timeout=280)
    reference = _reference("padded", batch=2)
    for result in results:
        _assert_exact([result["whole"]], reference)
        resumed = result["resumed"]
        assert resumed["losses"] == pytest.approx(reference["losses"][2:], abs=LOSS_TOL)
        _, _, weights = _differences(dict(resumed, losses=reference["losses"]), reference)
        assert weights <= WEIGHT_TOL


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("collation", ["packed", "padding-free"])
def test_sft_trainer(collation):
    """TRL's SFTTrainer with packing=True (best-fit packing into padding-free rows with
    position_ids), or padding_free=True alone (each batch flattened into one row).
    TRL is a test dependency (pyproject's test extra): no skip when it is missing."""
    _assert_exact(_run(2, "zigzag_ring_attn", collation, sft=True), _reference(collation, batch=2, sft=True))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sft_trainer_bf16_close_to_single_process():
    """bf16 autocast (SFTConfig's default on GPUs): per-step losses within 2e-3 of the bf16
    single-process run (measured 4e-5)."""
    results = _run(2, "ulysses_attn", "packed", sft=True, bf16=True)
    reference = _reference("packed", batch=2, sft=True, bf16=True)
    for result in results:
        loss, eval_loss, _ = _differences(result, reference)
        assert loss <= 2e-3 and eval_loss <= 2e-3, (loss, eval_loss)


# ------------------------------------------------------------------ clear errors (one process)
def _trainer(**args):
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        return Trainer(
            model=tiny_model("llama", **BYTE_LLAMA),
            args=TrainingArguments(output_dir=out, use_cpu=True, report_to=[], **args),
        )


def test_prepare_trainer_refuses_what_it_cannot_do_exactly():
    try:
        with pytest.raises(ValueError, match="label_smoothing_factor=0.1"):
            ec.prepare_trainer("zigzag_ring_attn", _trainer(label_smoothing_factor=0.1))
        trainer = ec.prepare_trainer("zigzag_ring_attn", _trainer())
        with pytest.raises(ValueError, match="already called"):
            ec.prepare_trainer("zigzag_ring_attn", trainer)
        ids = torch.ones(1, 8, dtype=torch.long)
        with pytest.raises(ValueError, match="'token_type_ids' has a value per token"):
            trainer._seq_parallel.shard({"input_ids": ids, "token_type_ids": ids})
        with pytest.raises(ValueError, match="without position_ids"):
            trainer._seq_parallel.shard({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 8])})
        with pytest.raises(ValueError, match="need labels"):
            trainer.prediction_step(trainer.model, {"input_ids": ids}, prediction_loss_only=True)
        with pytest.raises(ValueError, match="sp_size=3 does not divide"):
            ec.prepare_trainer("ulysses_attn", _trainer(), sp_size=3)
        with pytest.raises(ValueError, match="batch_rebalance"):
            ec.prepare_trainer("ulysses_attn", _trainer(train_sampling_strategy="batch_rebalance"))
        with pytest.raises(ValueError, match="eval_use_gather_object"):
            ec.prepare_trainer("ulysses_attn", _trainer(eval_use_gather_object=True))
        with pytest.raises(ValueError, match="balance_work needs a train dataset"):
            ec.prepare_trainer("ulysses_attn", _trainer(), balance_work=True)
    finally:
        ec.remove_seq_parallel_monkey_patch()


def test_balance_work_reads_each_rows_work_from_the_dataset():
    """prepare_trainer(..., balance_work=...): the Trainer's train sampler is WorkBalancedSampler
    (tests/unit/test_data_order.py checks how it deals), with each row's query x key products from
    TRL's seq_lengths, position_ids restarting per document, or the row as one document; in
    data_parallel too. Bad requests are refused by name."""
    from datasets import Dataset

    from easy_context.core.work_order import WorkBalancedSampler

    columns = {
        "seq_lengths": {"input_ids": [[1] * 6, [1] * 4], "seq_lengths": [[2, 4], [4]]},
        "position_ids": {"input_ids": [[1] * 6, [1] * 4], "position_ids": [[0, 1, 0, 1, 2, 3], [0, 1, 2, 3]]},
        "input_ids": {"input_ids": [[1] * 6, [1] * 4]},
    }
    want = {"seq_lengths": [3 + 10, 10], "position_ids": [3 + 10, 10], "input_ids": [21, 10]}
    try:
        for mode in ("zigzag_ring_attn", "data_parallel"):
            for name, data in columns.items():
                trainer = _trainer(per_device_train_batch_size=2, seed=5)
                trainer.train_dataset = Dataset.from_dict(data)
                ec.prepare_trainer(mode, trainer, balance_work=True)
                sampler = trainer._get_train_sampler()
                assert isinstance(sampler, WorkBalancedSampler), (mode, name, sampler)
                assert sampler.work.tolist() == want[name], (mode, name, sampler.work)
                assert (sampler.dp_size, sampler.batch_size, sampler.seed) == (1, 2, 5)
                ec.remove_seq_parallel_monkey_patch()
        trainer = _trainer(train_sampling_strategy="group_by_length")
        trainer.train_dataset = Dataset.from_dict(columns["input_ids"])
        with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length'"):
            ec.prepare_trainer("zigzag_ring_attn", trainer, balance_work=True)
        trainer = _trainer()
        trainer.train_dataset = Dataset.from_dict(columns["input_ids"])
        with pytest.raises(ValueError, match="balance_work has 3 values for 2 train rows"):
            ec.prepare_trainer("zigzag_ring_attn", trainer, balance_work=[1, 2, 3])
        with pytest.raises(ValueError, match="non-negative"):
            ec.prepare_trainer("zigzag_ring_attn", trainer, balance_work=[1, -2])
    finally:
        ec.remove_seq_parallel_monkey_patch()


def test_streaming_data_with_several_dp_groups_is_refused():
    """accelerate evens iterable shards out by repeating samples; with dp > 1 we could not drop them."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, IterableDataset

    from easy_context.core.groups import Topology
    from easy_context.hf.trainer import _read_by_sp_group

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(4)

    trainer = SimpleNamespace(accelerator=SimpleNamespace(prepare_data_loader=None, process_index=0))
    _read_by_sp_group(trainer, Topology(world_size=4, sp_size=2, ring_degree=1))
    with pytest.raises(
        ValueError, match=r"IterableDataset \(streaming\) with several data-parallel groups \(dp_size=2\)"
    ):
        trainer.accelerator.prepare_data_loader(DataLoader(Stream()))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_trainer_misuse_on_two_ranks():
    for errors in run_ranks(misuse, 2, timeout=140):
        assert "use_cpu=True" in errors["use_cpu=False"] and "use_cpu=True" not in errors
        assert "got different batches" in errors["different rows"] and "[(1, 16), (1, 16)]" in errors["different rows"]


def test_prepare_trainer_data_parallel_leaves_the_trainer_alone():
    trainer = _trainer()
    cls = type(trainer)
    assert ec.prepare_trainer("data_parallel", trainer) is trainer and type(trainer) is cls
