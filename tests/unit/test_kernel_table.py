"""docs/kernels.md's backend table is the code's (tools/kernel_table.py), and follows it."""

import inspect

import torch

from easy_context.core import kernels
from tools import kernel_table


def test_doc_table_is_the_generated_one():
    assert kernel_table.in_doc(kernel_table.DOC.read_text()) == kernel_table.markdown(), (
        "docs/kernels.md is out of date: run python -m tools.kernel_table --write"
    )
    assert kernel_table.main(["--check"]) == 0


def test_cpu_rows_are_what_select_backend_picks(monkeypatch):
    monkeypatch.delenv("EASY_CONTEXT_KERNEL", raising=False)
    dtypes = dict(kernel_table.DTYPES)
    checked = 0
    for row in kernel_table.rows():
        if row["device"] != "CPU":
            continue
        assert row["head dim"] == "any"  # no CPU backend limits the head dim
        for head_dim, _ in kernel_table.HEAD_DIMS:
            q = torch.zeros(1, 2, 4, head_dim, dtype=dtypes[row["dtype"]])
            flags = {name: row[name] for name in kernel_table.features()}
            chosen = kernels.select_backend(q, **flags)
            # no backend here takes the call as it is (segments): the caller splits the block
            assert (chosen.name if chosen else None) == (row["backends"] or [None])[0], row
            checked += 1
    assert checked == len(kernel_table.DTYPES) * 2 ** len(kernel_table.features()) * len(kernel_table.HEAD_DIMS)


def test_a_new_backend_and_a_new_call_feature_appear_by_themselves(monkeypatch):
    """A backend that available_backends starts offering, and a new bool keyword of it (here a
    sliding window), show up in the table without touching the generator."""
    original = kernels.available_backends

    def available_backends(
        device_type, dtype, head_dim=None, capability=None, masked=False, softcap=False, window=False
    ):
        names = original(device_type, dtype, head_dim, capability, masked=masked, softcap=softcap)
        return (["flex"] if device_type == "cuda" and not softcap else []) + names

    monkeypatch.setattr(kernels, "available_backends", available_backends)
    assert kernel_table.features() == ["masked", "softcap", "window"]
    table = kernel_table.markdown()
    assert table.splitlines()[0] == (
        "| device | dtype | masked | softcap | window | head dim | serves | also usable (in order) |"
    )
    assert "| CUDA sm75 | fp32 | yes | no | yes | any | `flex` | `cuda_efficient`, `math` |" in table
    assert table != kernel_table.in_doc(kernel_table.DOC.read_text())
    assert kernel_table.main(["--check"]) == 1  # the doc no longer says what the code does
    assert "window" in inspect.signature(kernels.available_backends).parameters
