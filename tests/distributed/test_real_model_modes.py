"""SmolLM2-135M-Instruct, real pretrained weights (9 query heads over 3 K/V heads: Ulysses splits
them unevenly), in every mode at 2 gloo ranks and the Ulysses-based modes at 4 (3 + 2 + 2 + 2
heads) against the unpatched model in one process: logits, loss and every parameter gradient in
fp32 on 4,096 tokens of real text, and bf16 autocast, packed documents, padding and generation
with the sharded cache on 1,024 tokens. The ring modes split the sequence, not the heads: at 4
ranks they run in tests/distributed/test_attention_functions.py and test_generation.py on random
weights, which keeps this module at about 8 of CI's minutes.

One process group per world size runs every mode on one loaded model (the patch is applied
and removed around each), and the single-process references are computed once and written to
disk, where each rank reads the rows it holds (memory-mapped): 4,096 x 49,152 fp32 logits are
800 MB, too many to send back from every rank.
"""

import random
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from real_model import real_model_dir, real_text_ids
from trainer_runs import train

from easy_context import (
    apply_seq_parallel_monkey_patch,
    generate,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from easy_context.hf import active_patch

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

LONG, SHORT = 4096, 1024  # fp32: every mode at 4K; bf16, packed, padded and generation: 1K
PACKED = [300, 1, 451, 17, 255]  # documents of real text, crossing every shard boundary at 2 and 4 ranks
LEFT_PAD = 77  # row 0 of the padded batch starts with 77 padding tokens
PROMPT = 512  # generation: greedy, 8 new tokens after a 512-token prompt
GREEDY = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
RUNS = {
    2: [("zigzag_ring_attn", {}), ("dist_flash_attn", {}), ("ulysses_attn", {})],  # Ulysses: 5 + 4 heads
    4: [("ulysses_attn", {}), ("usp_attn", {"ring_degree": 2})],  # Ulysses: 3 + 2 + 2 + 2 heads
}
CASES = ("fp32", "bf16", "packed", "padded")


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)


def batch_of(case, ids):
    """(input_ids, position_ids or None, attention_mask or None, targets) of a case."""
    if case == "fp32":
        row = ids[:, :LONG]
        return row, None, None, shifted(row)
    row = ids[:, :SHORT]
    if case == "bf16":
        return row, None, None, shifted(row)
    if case == "packed":
        positions = torch.cat([torch.arange(n) for n in PACKED]).unsqueeze(0)
        targets = shifted(row)
        starts = torch.cumsum(torch.tensor(PACKED), 0)
        targets[0, starts - 1] = -100  # no target across a document's end
        return row, positions, None, targets
    rows = torch.cat([row, ids[:, SHORT : 2 * SHORT]])
    mask = torch.ones_like(rows)
    mask[0, :LEFT_PAD] = 0
    targets = shifted(rows).masked_fill(mask == 0, -100)
    return rows, None, mask, targets


def shifted(ids):
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    return targets


def loss_and_backward(model, ids, positions, mask, targets, group=None):
    """The token-mean loss over the whole (sharded) batch, back-propagated; (logits, loss)."""
    logits = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    stats = torch.stack([loss_sum.detach(), (targets != -100).sum().float()])
    if group is not None:
        dist.all_reduce(stats, group=group)
    (loss_sum / stats[1]).backward()
    return logits.detach().float(), (stats[0] / stats[1]).item()


def run_case(model, case, ids, positions, mask, targets, group=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16"):
        return loss_and_backward(model, ids, positions, mask, targets, group)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The unpatched model on each whole batch, in one process: {case: file}; bf16 also saves
    the fp32 truth's file (the bound: at most 2x one process's bf16 error against it)."""
    folder, ids = tmp_path_factory.mktemp("real_reference"), real_text_ids(2 * SHORT + LONG)
    model, files = load(real_model_dir()), {}
    for case in (*CASES, "bf16-truth"):
        inputs = batch_of(case.removesuffix("-truth"), ids)
        logits, loss = run_case(model, "fp32" if case == "bf16-truth" else case, *inputs)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        files[case] = folder / f"{case}.pt"
        torch.save({"logits": logits, "loss": loss, "grads": grads}, files[case])
    prompt = ids[:, :PROMPT]
    with torch.no_grad():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), **GREEDY)
    files["generate"] = folder / "generate.pt"
    torch.save({"sequences": want.sequences, "logits": torch.stack(want.logits)}, files["generate"])
    return ids, files


def errors(logits, loss, grads, reference, rows, mask=None):
    """(logits max error relative to the largest reference logit, loss error, the worst
    parameter's max gradient error relative to its largest entry), over `rows` of the batch
    (this rank's positions) and the tokens `mask` keeps."""
    want = reference["logits"].gather(1, rows.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    keep = torch.ones_like(rows, dtype=torch.bool) if mask is None else mask.gather(1, rows).bool()
    logits_err = ((logits - want).abs().amax(-1)[keep].max() / want[keep].abs().max()).item()
    grad_err = max(
        ((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in reference["grads"].items()
    )
    return logits_err, abs(loss - reference["loss"]), grad_err


def worker(rank, world_size, model_dir, ids, files):
    model, results = load(model_dir), {}
    for mode, options in RUNS[world_size]:
        apply_seq_parallel_monkey_patch(mode, model, **options)
        group = active_patch().groups().sp
        for case in CASES:
            full_ids, positions, mask, targets = batch_of(case, ids)
            local = prepare_seq_parallel_inputs(
                mode, full_ids, positions, targets, rank, world_size, "cpu", mask, **options
            )
            logits, loss = run_case(
                model,
                case,
                local["local_input_ids"],
                local["local_position_ids"],
                local.get("local_attention_mask"),
                local["local_target_ids"],
                group,
            )
            grads = {}
            for name, p in model.named_parameters():
                grads[name] = p.grad.contiguous()
                dist.all_reduce(grads[name], group=group)
            rows = prepare_seq_parallel_inputs(
                mode,
                torch.arange(full_ids.shape[1]).expand_as(full_ids),
                None,
                None,
                rank,
                world_size,
                "cpu",
                **options,
            )["local_input_ids"]
            for against in ("", "-truth") if case == "bf16" else ("",):
                reference = torch.load(files[case + against], mmap=True)
                results[mode, case + against] = errors(logits, loss, grads, reference, rows, mask)
        results[mode, "generate"] = generation_matches(model, mode, options, ids, files["generate"])
        remove_seq_parallel_monkey_patch()
    return results


def generation_matches(model, mode, options, ids, reference_file):
    """Greedy decoding of 8 tokens after a 512-token prompt against the unpatched model's:
    (tokens equal, worst logits error)."""
    prompt, want = ids[:, :PROMPT], torch.load(reference_file)
    got = generate(mode, model, prompt, attention_mask=torch.ones_like(prompt), **GREEDY)
    error = float((torch.stack(got.logits) - want["logits"]).abs().max())
    return torch.equal(got.sequences, want["sequences"]), error


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world_size", [2, 4])
def test_real_model_every_mode_matches_single_process(world_size, references):
    ids, files = references
    per_rank = run_ranks(worker, world_size, str(real_model_dir()), ids, files, timeout=1400)
    for rank, results in enumerate(per_rank):
        for (mode, case), value in results.items():
            print(f"P={world_size} rank {rank} {mode} {case}: {value}")
        for mode, _ in RUNS[world_size]:
            tokens_equal, logits_err = results[mode, "generate"]
            assert tokens_equal and logits_err <= 1e-3, (mode, results[mode, "generate"])
            for case in CASES:
                if case == "bf16":
                    ours, theirs = results[mode, "bf16-truth"], bf16_baseline(files)
                    for mine, baseline in zip(ours, theirs):
                        assert mine <= 2 * baseline + 1e-6, (mode, ours, theirs)
                    continue
                logits_err, loss_err, grad_err = results[mode, case]
                assert logits_err <= 1e-5 and loss_err <= 1e-5 and grad_err <= 1e-4, (mode, case, results[mode, case])


def bf16_baseline(files):
    """One process's bf16 autocast errors against its fp32 truth (all rows)."""
    own, truth = (torch.load(files[name], mmap=True) for name in ("bf16", "bf16-truth"))
    rows = torch.arange(own["logits"].shape[1]).unsqueeze(0)
    return errors(own["logits"], own["loss"], own["grads"], truth, rows)


def real_documents() -> dict:
    """Real text cut into documents of 40-300 tokens (no layout divides them): 16 to train on, 4
    to evaluate and predict."""
    ids, rng, rows, at = real_text_ids(LONG)[0].tolist(), random.Random(3), [], 0
    while len(rows) < 20:
        length = rng.randrange(40, 120 if len(rows) >= 16 else 300)
        rows.append(ids[at : at + length])
        at += length
    return {"train": rows[:16], "eval": rows[16:]}


@pytest.mark.timeout(900)
def test_hf_trainer_on_the_real_weights_trains_like_one_process():
    """prepare_trainer with ulysses_attn (5 + 4 heads) at 2 ranks: HF Trainer's per-step losses,
    eval loss, predict() logits and final weights as the unpatched Trainer's in one process
    (packed rows; SGD, so a weight difference is the learning rate times a gradient difference)."""
    spec = dict(
        collator="packed", batch=2, accumulate=2, steps=2, learning_rate=1e-3, eval_batch=2,
        model_dir=str(real_model_dir()), documents=real_documents(),
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        reference = run_ranks(train, 1, dict(spec, mode=None, out=out), timeout=600)[0]
    with tempfile.TemporaryDirectory() as out:
        results = run_ranks(train, 2, dict(spec, mode="ulysses_attn", out=out), timeout=600)
    for rank, result in enumerate(results):
        losses = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True))
        eval_loss = abs(result["eval_loss"] - reference["eval_loss"])
        logits = (result["predictions"] - reference["predictions"]).abs().max().item()
        weights = max((result["weights"][k] - w).abs().max().item() for k, w in reference["weights"].items())
        print(
            f"rank {rank}: losses {losses:.1e}, eval loss {eval_loss:.1e}, logits {logits:.1e}, weights {weights:.1e}"
        )
        assert len(result["losses"]) == 2 and losses <= 1e-5 and eval_loss <= 1e-5, (rank, result["losses"])
        assert logits <= 1e-4 and weights <= 1e-7, (rank, logits, weights)
