"""Every tensor handed to a collective is made on the data's device.

NCCL accepts only CUDA tensors, so a flag or count built with `torch.tensor([...])` (no
`device=`) and then all-reduced crashes every GPU run, while gloo on CPU runs it happily.
There is no CUDA here, so this test catches the class of defect on CPU: during one model
forward + backward (and the public helpers a training step uses) on 2 gloo ranks, tensors
made by a factory function without `device=` are remembered, and any collective or P2P call
that is handed one of them (or a view of one) is reported with both call sites. A tensor
later passed through `.to(device)` counts as placed (on CPU that returns the same tensor).

Both layers of wrapping call the original functions: the run itself is unchanged. A
violation is recorded, not raised, so no rank is left waiting in a collective; the test
asserts on the records afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from ranks import run_ranks
from tiny_models import tiny_batch, tiny_model

from easy_context import (
    apply_seq_parallel_monkey_patch,
    gather_seq_parallel_outputs,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from easy_context.hf.loss import global_token_mean
from easy_context.versions import enable_activation_checkpointing

SEQ = 128
FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "randn",
    "rand",
    "randint",
    "linspace",
    "eye",
    "empty_strided",
)
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "batch_isend_irecv",
    "isend",
    "irecv",
    "send",
    "recv",
)
P2P, ALL_TO_ALL = {"batch_isend_irecv", "isend", "irecv", "send", "recv"}, {"all_to_all_single", "all_to_all"}
# (mode, options, model type, activation checkpointing, the communication the mode must be
# seen to use). 2 ranks: usp_attn runs once as a pure ring (ring_degree 2) and once as pure
# Ulysses (ring_degree 1); dist_flash_attn also with checkpointing, where its forward is
# served from the remat cache inside the backward.
RUNS = [
    ("zigzag_ring_attn", {}, "llama", False, P2P),
    ("ulysses_attn", {}, "llama", False, ALL_TO_ALL),
    ("usp_attn", {"ring_degree": 2}, "llama", False, P2P),
    ("usp_attn", {"ring_degree": 1}, "qwen3", False, ALL_TO_ALL),
    ("dist_flash_attn", {}, "llama", False, P2P),
    ("dist_flash_attn", {}, "llama", True, P2P),
]
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _site(stack) -> str:
    """The innermost frames outside torch: where the call was written, and its callers."""
    frames = [f for f in stack if not os.path.abspath(f.filename).startswith(_TORCH_DIR)]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} ({f.name})" for f in reversed(frames[-3:]))


def _explicit_device(args, kwargs) -> bool:
    """Whether a Tensor.to call names a device (a device, a device string or a tensor to match)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


class DevicePlacementRecorder:
    """Remembers storages of tensors made without `device=` and reports collectives that get one."""

    def __init__(self):
        self.made = {}  # storage data_ptr -> "torch.tensor at hf.py:76 (...)"
        self.keep = []  # the tensors themselves: their memory is never reused while we watch
        self.violations = []  # (collective, message)
        self.calls = collections.Counter()  # collective name -> calls seen (proves the wrapping works)

    # ------------------------------------------------------------------ factories
    def _remember(self, tensor: torch.Tensor, what: str, stack) -> None:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr:  # 0-element tensors have no storage (ptr 0): they carry nothing to send
            self.made[ptr] = f"{what} at {_site(stack)}"
            self.keep.append(tensor)

    def _factory(self, name, original):
        @functools.wraps(original)
        def factory(*args, **kwargs):
            result = original(*args, **kwargs)
            copies_a_tensor = name in ("tensor", "as_tensor") and args and isinstance(args[0], torch.Tensor)
            if kwargs.get("device") is None and not copies_a_tensor and isinstance(result, torch.Tensor):
                self._remember(result, f"torch.{name}(...) without device=", traceback.extract_stack(limit=12)[:-1])
            return result

        return factory

    def _to(self, original):
        @functools.wraps(original)
        def to(tensor, *args, **kwargs):
            result = original(tensor, *args, **kwargs)
            # x.to(device) is a legitimate way to place a tensor, and on CPU it returns x itself
            if isinstance(result, torch.Tensor) and _explicit_device(args, kwargs):
                self.made.pop(result.untyped_storage().data_ptr(), None)
            return result

        return to

    # ---------------------------------------------------------------- collectives
    def _check(self, name, value, stack) -> None:
        if isinstance(value, (list, tuple)):
            for item in value:
                self._check(name, item, stack)
        elif isinstance(value, dist.P2POp):
            self._check(name, value.tensor, stack)
        elif isinstance(value, torch.Tensor):
            ptr = value.untyped_storage().data_ptr() if value.numel() else 0
            if ptr in self.made:
                self.violations.append(
                    (name, f"dist.{name} at {_site(stack)} was given a tensor made by {self.made[ptr]}")
                )

    def _collective(self, name, original):
        @functools.wraps(original)
        def collective(*args, **kwargs):
            self.calls[name] += 1
            stack = traceback.extract_stack()[:-1]
            for value in (*args, *kwargs.values()):
                self._check(name, value, stack)
            return original(*args, **kwargs)

        return collective

    @contextlib.contextmanager
    def watching(self):
        patches = [(torch, name) for name in FACTORIES]
        patches += [(dist, name) for name in COLLECTIVES if hasattr(dist, name)]
        # P2POp checks its op against c10d's own isend/irecv, and batch_isend_irecv calls
        # op.op: replace those names there too so P2P ops built during the run stay valid.
        patches += [(c10d, "isend"), (c10d, "irecv"), (torch.Tensor, "to")]
        saved = [(module, name, getattr(module, name)) for module, name in patches]
        wrappers = {}  # one wrapper per original function: dist.isend is c10d.isend must stay true
        try:
            for module, name, original in saved:
                if id(original) not in wrappers:
                    if module is torch:
                        wrappers[id(original)] = self._factory(name, original)
                    elif module is torch.Tensor:
                        wrappers[id(original)] = self._to(original)
                    else:
                        wrappers[id(original)] = self._collective(name, original)
                setattr(module, name, wrappers[id(original)])
            yield self
        finally:
            for module, name, original in saved:
                setattr(module, name, original)
            self.keep.clear()
            self.made.clear()


def placement_worker(rank, world_size, runs):
    reports = []
    for mode, options, model_type, checkpointing, _ in runs:
        apply_seq_parallel_monkey_patch(mode, model_type, **options)
        model = tiny_model(model_type)
        if checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        input_ids, target_ids = tiny_batch(1, SEQ)
        local = prepare_seq_parallel_inputs(mode, input_ids, None, target_ids, rank, world_size, "cpu", **options)
        recorder = DevicePlacementRecorder()
        with recorder.watching():
            logits = model(
                input_ids=local["local_input_ids"], position_ids=local["local_position_ids"], use_cache=False
            ).logits
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1).float(), local["local_target_ids"].flatten(), ignore_index=-100, reduction="sum"
            )
            loss, _ = global_token_mean(loss_sum, local["local_target_ids"])
            loss.backward()
            gather_seq_parallel_outputs(mode, logits.detach(), **options)
        grads_seen = all(p.grad is not None for p in model.parameters())
        reports.append(
            ((mode, str(options), model_type, checkpointing), recorder.violations, grads_seen, set(recorder.calls))
        )
        remove_seq_parallel_monkey_patch()
    return reports


def test_recorder_sees_a_cpu_flag_and_accepts_placed_tensors():
    """The wrappers themselves, in one process: a factory call without device= is caught
    when it reaches a collective (direct, in a list, or in a P2POp), the accepted ways of
    placing a tensor are not, and every patched name is restored."""
    before = (torch.tensor, torch.zeros, dist.all_reduce, c10d.isend, torch.Tensor.to)
    recorder = DevicePlacementRecorder()
    x = torch.randn(3, device="cpu")
    with recorder.watching():
        bad, placed = torch.tensor([1], dtype=torch.int32), torch.zeros(2, device=x.device)
        moved, like, empty = torch.ones(2).to(x.device), torch.empty_like(bad), torch.zeros(0)
        stack = traceback.extract_stack()
        for value in (bad[:1], [x, bad], placed, moved, like, empty, x.new_zeros(2)):
            recorder._check("all_reduce", value, stack)
        op = c10d.P2POp.__new__(c10d.P2POp, dist.isend, bad)  # P2POp accepts the wrapped isend
        op.tensor = bad
        recorder._check("batch_isend_irecv", [op], stack)
    assert [name for name, _ in recorder.violations] == ["all_reduce", "all_reduce", "batch_isend_irecv"]
    assert "made by torch.tensor(...) without device= at test_device_placement.py" in recorder.violations[0][1]
    assert before == (torch.tensor, torch.zeros, dist.all_reduce, c10d.isend, torch.Tensor.to)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_collective_gets_tensors_made_on_the_data_device():
    reports = run_ranks(placement_worker, 2, RUNS)
    problems = {}  # message -> the (rank, run)s where it happened
    for rank, per_run in enumerate(reports):
        for (*run, expected), (run_name, violations, grads_seen, called) in zip(RUNS, per_run):
            assert grads_seen, (rank, run)  # the backward really ran
            # the wrappers really saw the mode's communication and the helpers' collectives
            assert called & expected and {"all_reduce", "all_gather"} <= called, (rank, run, called)
            for _, message in violations:
                problems.setdefault(message, []).append(f"rank {rank} {run_name}")
    assert not problems, (
        "collectives were given tensors made without device= (NCCL refuses CPU tensors):\n"
        + "\n".join(
            f"{message}\n    in {len(where)} rank x run(s): {', '.join(dict.fromkeys(where))}"
            for message, where in problems.items()
        )
    )
