"""Where the peak memory of a step goes: live tensor bytes, attributed to the op (and module)
that produced them, at the moment the total peaks. CPU or CUDA; a profiling aid for
bench_train.py --profile, not a measurement of RSS (allocator caching, kernel-internal
buffers and the Python heap are not seen).

Every storage an op creates is counted once, from creation until it is freed (a weakref
finalizer on the storage: PyTorch keeps one Python object per storage).
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorTrace(TorchDispatchMode):
    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}  # storage id -> (bytes, label)
        self.total = self.peak = 0
        self._peak_live: dict[int, tuple[int, str]] = {}
        self.phase = "forward"
        self._modules: list[str] = []
        self._hooks = []
        # storages that exist before the step (weights, buffers) are not the step's memory
        self._preexisting = (
            {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())} if model is not None else set()
        )
        if model is not None:
            for name, module in model.named_modules():
                if name and name.count(".") <= 3:
                    self._hooks.append(module.register_forward_pre_hook(self._enter(name)))
                    self._hooks.append(module.register_forward_hook(self._leave))

    def _enter(self, name):
        def hook(module, args):
            self._modules.append(name)  # returns None: the module's inputs are unchanged

        return hook

    def _leave(self, module, args, output):
        if self._modules:
            self._modules.pop()  # returns None: the module's output is unchanged

    def _label(self, func) -> str:
        where = self._modules[-1] if self._modules else "-"
        # layers.3.self_attn -> layers.N.self_attn: one row per kind of module
        where = ".".join("N" if part.isdigit() else part for part in where.split("."))
        backward = torch._C._current_graph_task_id() != -1
        return f"{'bwd' if backward else 'fwd'} {where} {func.overloadpacket.__name__}"

    def _free(self, key: int) -> None:
        size, _ = self.live.pop(key, (0, ""))
        self.total -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self.live or key in self._preexisting or storage.nbytes() == 0:
                continue
            self.live[key] = (storage.nbytes(), self._label(func))
            self.total += storage.nbytes()
            weakref.finalize(storage, self._free, key)
            if self.total > self.peak:
                self.peak = self.total
                self._peak_live = dict(self.live)
        return out

    def report(self, top: int = 15, tokens: int | None = None) -> str:
        by_label = collections.Counter()
        for size, label in self._peak_live.values():
            by_label[label] += size
        unit = f" | KiB/token ({tokens} tokens)" if tokens else ""
        lines = [
            f"peak live tensor memory {self.peak / 2**20:.1f} MiB",
            f"| produced by (phase module op) | MiB{unit} |",
            "|---|---|" + ("---|" if tokens else ""),
        ]
        for label, size in by_label.most_common(top):
            extra = f" | {size / 1024 / tokens:.2f}" if tokens else ""
            lines.append(f"| {label} | {size / 2**20:.1f}{extra} |")
        rest = sum(by_label.values()) - sum(s for _, s in by_label.most_common(top))
        lines.append(f"| (other) | {rest / 2**20:.1f}{' | ' + format(rest / 1024 / tokens, '.2f') if tokens else ''} |")
        return "\n".join(lines)

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)
