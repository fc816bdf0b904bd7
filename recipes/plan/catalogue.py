"""What the planner plans for: model shapes (presets and HF configs), devices, and the
options of one run (mode, split, memory options, ZeRO / FSDP setting: sharding.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from recipes.plan.sharding import SHARDINGS, ZERO_CHOICES

__all__ = [
    "DEVICES",
    "GIB",
    "MIB",
    "PRESETS",
    "ZERO_CHOICES",
    "Device",
    "ModelShape",
    "Options",
    "PlanError",
    "default_host_memory",
    "device_of_gpu",
    "get_device",
    "load_model",
    "local_gpus",
    "machine_memory_gib",
    "shape_from_config",
]

GIB, MIB = 2**30, 2**20


class PlanError(ValueError):
    """Bad input or nothing fits; the message says what would work."""


# ----------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    experts: int = 1  # routed experts per MoE layer (1: dense MLP)
    experts_per_token: int = 1

    @property
    def q(self) -> int:  # query (and attention output) width
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:  # key (= value) width
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        attn = self.hidden * (self.q + 2 * self.kv) + self.q * self.hidden
        mlp = 3 * self.hidden * self.intermediate * self.experts + (
            self.hidden * self.experts if self.experts > 1 else 0
        )
        return attn + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params * (1 if self.tied else 2) + self.hidden

    @property
    def active_intermediate(self) -> int:  # MLP width a token goes through
        return self.intermediate * self.experts_per_token

    @property
    def matmul_params_per_token(self) -> int:
        """Weights a token multiplies with (2 FLOPs each in the forward): layers + output layer."""
        attn = self.hidden * (self.q + 2 * self.kv) + self.q * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.active_intermediate) + self.vocab * self.hidden


# Published configs (config.json of the hub checkpoints).
PRESETS = {
    "llama-2-7b": ModelShape("llama-2-7b", 4096, 11008, 32, 32, 32, 128, 32000),
    "llama-2-13b": ModelShape("llama-2-13b", 5120, 13824, 40, 40, 40, 128, 32000),
    "llama-3-8b": ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256),
    "llama-3-70b": ModelShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256),
    "mistral-7b": ModelShape("mistral-7b", 4096, 14336, 32, 32, 8, 128, 32000),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 3584, 18944, 28, 28, 4, 128, 152064),
    # the downloadable model (python -m recipes.models get smollm2-135m-instruct; its config.json):
    # 134,515,008 parameters, as the checkpoint holds
    "smollm2-135m-instruct": ModelShape("smollm2-135m-instruct", 576, 1536, 30, 9, 3, 64, 49152, tied=True),
    # benchmarks/bench_train.py's model (what the CPU validation measures)
    "tiny-bench": ModelShape("tiny-bench", 256, 688, 4, 4, 2, 64, 32000),
}
PRESETS["llama-3.1-8b"] = replace(PRESETS["llama-3-8b"], name="llama-3.1-8b")


def shape_from_config(config, name: str) -> ModelShape:
    config = getattr(config, "text_config", None) or config
    get = lambda *keys, default=None: next(
        (getattr(config, k) for k in keys if getattr(config, k, None) is not None), default
    )
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if not hidden or not heads or not get("num_hidden_layers") or not get("vocab_size"):
        raise PlanError(f"{name}: the config has no hidden_size / num_attention_heads / num_hidden_layers / vocab_size")
    experts = get("num_local_experts", "num_experts", "n_routed_experts", default=1) or 1
    inter = get("moe_intermediate_size", default=None) if experts > 1 else None
    return ModelShape(
        name=name,
        hidden=hidden,
        intermediate=inter or get("intermediate_size", default=4 * hidden),
        layers=get("num_hidden_layers"),
        heads=heads,
        kv_heads=get("num_key_value_heads", default=heads),
        head_dim=get("head_dim", default=hidden // heads),
        vocab=get("vocab_size"),
        tied=bool(get("tie_word_embeddings", default=False)),
        experts=experts,
        experts_per_token=get("num_experts_per_tok", "num_experts_per_token", default=1) if experts > 1 else 1,
    )


def load_model(name: str) -> ModelShape:
    """A preset name, a local config dir / config.json, or a hub name already in the local cache."""
    if name.lower() in PRESETS:
        return PRESETS[name.lower()]
    try:
        from transformers import AutoConfig
    except ImportError as error:  # pragma: no cover
        raise PlanError(
            f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}) and transformers is missing"
        ) from error
    path = name
    if os.path.isfile(path):
        path = os.path.dirname(path) or "."
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=not os.environ.get("EASY_CONTEXT_PLAN_ONLINE"))
    except Exception as error:  # OSError, ValueError, EnvironmentError from the hub client
        raise PlanError(
            f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}), not a local config folder, and not a hub "
            f"model in the local cache ({type(error).__name__}: {str(error).splitlines()[0][:160]}); set "
            "EASY_CONTEXT_PLAN_ONLINE=1 to look it up on the hub"
        ) from None
    return shape_from_config(config, name)


# ---------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    tflops: float  # dense bf16 peak (fp32 for cpu), per device
    link_gbs: float  # per-device bandwidth to the other devices of its node, one direction
    network_gbs: float  # per-device bandwidth across nodes
    pcie_gbs: float  # host <-> device copies
    runtime_gib: float  # CUDA context, NCCL and cuBLAS workspaces (cpu: interpreter + torch + transformers)
    per_node: int = 8
    optimizer_params_per_s: float = 5e8  # CPU Adam (offloaded optimizer), per rank
    memory_is_host: bool = False  # cpu: what is offloaded to host memory stays in the rank's memory
    # host RAM of a node of these GPUs when the plan is not for this machine (--host-memory):
    # a DGX-class node's (DGX A100 320GB: 1 TiB; DGX A100 640GB, H100, H200: 2 TiB)
    default_host_memory_gib: float = 2048.0


def machine_memory_gib() -> float | None:
    """This machine's RAM in GiB (os.sysconf; psutil, imported only here, where sysconf has no
    answer), capped by a cgroup memory limit where a container sets one; None if unknown."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not Linux / macOS
        try:
            import psutil

            total = psutil.virtual_memory().total
        except Exception:  # ImportError, or psutil without an answer
            return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total / GIB


def _cpu_memory_gib() -> float:
    return machine_memory_gib() or 16.0


def device_of_gpu(model: str) -> str:
    """The catalogue's name for a GPU model as the driver or torch names it ("NVIDIA H100 80GB
    HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", ...): its board decides its
    peak (an H100 on PCIe runs at 756 of the SXM board's 989 TFLOP/s). A model not in the
    catalogue is its lower-cased name (get_device refuses it by that name)."""
    name = model.upper().replace("NVIDIA", "").strip()
    if "H200" in name:
        return "h200-nvl" if "NVL" in name else "h200"
    if "H100" in name:
        if "NVL" in name:
            return "h100-nvl"
        return "h100-pcie" if "PCIE" in name else "h100-80g"
    if "A100" in name:
        return "a100-40g" if "40GB" in name.replace(" ", "") else "a100-80g"
    return model.strip().lower()


def local_gpus() -> list[str]:
    """The catalogue names of this machine's NVIDIA GPUs, from the driver's /proc entries (no
    CUDA initialised, nothing imported); [] where there are none or no driver."""
    import glob

    names = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as f:
                model = next((line.split(":", 1)[1] for line in f if line.startswith("Model:")), "")
        except OSError:
            continue
        names.append(device_of_gpu(model))
    return names


# tflops: dense bf16 Tensor Core peaks, the datasheets' "with sparsity" figures halved: NVIDIA
# H100 (SXM 1,979, PCIe 1,513, NVL 1,671) and H200 (SXM 1,979, NVL 1,671); A100 312. The one
# place these numbers live (MFU divides by them: benchmarks/bench_long_context.py). The links
# of the PCIe boards: PCIe Gen5 x16 (H100 PCIe), a pair's NVLink bridge, 600 GB/s both ways
# (NVL boards).
DEVICES = {
    "a100-40g": Device("a100-40g", 40.0, 312.0, 300.0, 25.0, 25.0, 2.0, default_host_memory_gib=1024.0),
    "a100-80g": Device("a100-80g", 80.0, 312.0, 300.0, 25.0, 25.0, 2.0),
    "h100-80g": Device("h100-80g", 80.0, 989.0, 450.0, 50.0, 50.0, 2.0),  # SXM
    "h100-pcie": Device("h100-pcie", 80.0, 756.0, 50.0, 50.0, 50.0, 2.0),
    "h100-nvl": Device("h100-nvl", 94.0, 835.0, 300.0, 50.0, 50.0, 2.0),
    "h200": Device("h200", 140.0, 989.0, 450.0, 50.0, 50.0, 2.0),  # SXM
    "h200-nvl": Device("h200-nvl", 140.0, 835.0, 300.0, 50.0, 50.0, 2.0),
    # The CPU machine the validation runs on: one process per rank, fp32, gloo. Runtime =
    # RSS of a rank before the step minus its weights (docs/bench_train.csv: 392-397 MiB).
    "cpu": Device(
        "cpu", 0.0, 0.1, 5.0, 1.0, 1000.0, 395 / 1024, per_node=1 << 20, optimizer_params_per_s=2e8, memory_is_host=True
    ),
}
DEVICES["h100"] = DEVICES["h100-80g"]
DEVICES["a100"] = DEVICES["a100-80g"]


def get_device(
    name: str | None,
    memory_gib: float | None = None,
    *,
    per_node: int | None = None,
    link_gbs: float | None = None,
    network_gbs: float | None = None,
) -> Device:
    """A named device; memory, devices per node and the two link bandwidths (inside a node,
    across nodes) override its own where given."""
    if name is None:
        name = "h100-80g"
    key = name.lower()
    if key not in DEVICES:
        raise PlanError(
            f"unknown GPU {name!r}; choose one of {sorted(set(DEVICES))} (or give --gpu-memory-gib with any of them)"
        )
    device = DEVICES[key]
    if key == "cpu":
        device = replace(device, memory_gib=_cpu_memory_gib())
    if memory_gib is not None:
        if memory_gib <= 0:
            raise PlanError(f"--gpu-memory-gib must be positive, got {memory_gib}")
        device = replace(device, memory_gib=memory_gib)
    for flag, field, value in (
        ("--gpus-per-node", "per_node", per_node),
        ("--link-gbs", "link_gbs", link_gbs),
        ("--network-gbs", "network_gbs", network_gbs),
    ):
        if value is not None:
            if value <= 0:
                raise PlanError(f"{flag} must be positive, got {value}")
            device = replace(device, **{field: value})
    return device


def default_host_memory(device: Device, gpus: int) -> tuple[float, str]:
    """(GiB of host memory per node, where the number comes from) when --host-memory is not
    given: this machine's RAM where the plan is for this machine (--gpu cpu, or this machine
    has at least a node's worth, min(gpus, per node), of the named GPU), else the named GPU's
    node default (Device.default_host_memory_gib)."""
    if device.memory_is_host or local_gpus().count(device.name) >= min(gpus, device.per_node):
        ram = machine_memory_gib()
        if ram:
            return ram, "this machine's RAM"
    return device.default_host_memory_gib, f"the default for a node of {device.name}; --host-memory to change"


# ---------------------------------------------------------------------------- options
@dataclass(frozen=True)
class Options:
    mode: str
    sp: int
    ring_degree: int
    checkpointing: bool = False
    offload_checkpoints: bool = False
    tiled_mlp: int = 0  # tokens per MLP tile (0: off)
    loss_chunk: int = 0  # tokens per loss chunk (0: the whole local sequence at once)
    zero: str = "none"  # how the model states are kept: a name of sharding.SHARDINGS (DDP, ZeRO-3, FSDP2)

    def __post_init__(self):
        if self.zero not in SHARDINGS:
            raise PlanError(f"unknown ZeRO / FSDP setting {self.zero!r}; choose from {list(SHARDINGS)}")

    @property
    def ulysses_degree(self) -> int:
        return self.sp // self.ring_degree
