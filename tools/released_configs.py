"""Released checkpoints' configs (tests/data/released_configs/, SOURCES.md says where each came
from), shrunk for the model sweep with their feature fields as released.

    python -m tools.released_configs            # each config: exact, refused (by name) or failing

Shrunk: widths, heads, vocabulary, experts (tools/tiny_configs.py's rules), and depth to the
shortest prefix of the layer pattern that holds every layer kind. Kept: every other field as
released (norms, biases, softcaps, sinks, MoE routing, rope type and factors), with every length
a model compares positions against shorter than the sweep's sequence (`LENGTHS`): windows and
attention chunks become tiny_configs.WINDOW and a rope's original context 64 tokens, so the
sweep's 128 tokens cross each (and longrope, llama3 and yarn use their long-context factors).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tools.tiny_configs import WINDOW

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "released_configs"
ORIGINAL_CONTEXT = 64  # shorter than exact_step.SEQ
# The length fields a released config may keep, at the top level or in its rope parameters, and
# what each becomes: windows (MiMo's sliding_window_size, from which its config derives
# sliding_window), attention chunks, and the context a rope was extended from (Phi-3 keeps it at
# the top level and transformers moves it into rope_parameters; gpt-oss's initial_context_length).
LENGTHS = dict(
    sliding_window=WINDOW,
    sliding_window_size=WINDOW,
    attention_chunk_size=WINDOW,
    original_max_position_embeddings=ORIGINAL_CONTEXT,
    initial_context_length=ORIGINAL_CONTEXT,
)
_NOT_FIELDS = {"architectures", "transformers_version", "torch_dtype", "dtype", "auto_map", "quantization_config"}


def names() -> list[str]:
    return sorted(path.stem for path in CONFIGS.glob("*.json"))


def _shrunk_lengths(fields: dict) -> dict:
    """`fields` with each of LENGTHS it holds as a number set to the sweep's (None stays None)."""
    return {
        k: LENGTHS[k] if k in LENGTHS and isinstance(v, int) and not isinstance(v, bool) else v
        for k, v in fields.items()
    }


def _shrunk_rope(parameters: dict, head_dim: int) -> dict:
    parameters = _shrunk_lengths(parameters)
    if isinstance(parameters.get("mrope_section"), list):  # sections of the rotary frequencies, summed
        half = int(head_dim * parameters.get("partial_rotary_factor", 1.0)) // 2
        sections = [half // len(parameters["mrope_section"])] * len(parameters["mrope_section"])
        sections[0] += half - sum(sections)
        parameters["mrope_section"] = sections
    for key in ("short_factor", "long_factor"):  # longrope: one factor per rotary frequency
        if isinstance(parameters.get(key), list):
            parameters[key] = parameters[key][: head_dim // 2]
    return parameters


# Fields tools/tiny_configs.py's rules do not know, set wherever a released config has them:
# per-family widths and head dims (LFM2, MiniMax, Falcon, Qwen3.5's linear attention, Nemotron-H).
_SET = dict(
    block_dim=64,
    conv_dim=64,
    conv_dim_out=64,
    attention_head_dim=16,
    rotary_dim=16,
    num_heads=4,
    num_kv_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    n_groups=2,
    chunk_size=32,
    time_step_rank=32,
    global_head_dim=32,  # Gemma 4's full-attention layers
    moe_latent_size=32,  # Nemotron 3's experts
)
_NARROWED = ("block_ff_dim", "shared_intermediate_size", "moe_intermediate_size")  # to 32 where not 0


def _one_period(pattern):
    """The shortest prefix of a layer pattern (a list of kinds, or Nemotron-H's string) that holds
    every kind in it; two layers where there is one kind."""
    last_new = max(pattern.index(kind) for kind in set(pattern))
    return pattern[: max(last_new + 1, 2)]


def shrunk(name: str) -> tuple[str, dict]:
    """(model type, config fields) of a released config, shrunk (see the module docstring)."""
    from tools.tiny_configs import MAMBA, MLA, SIZES, shrink_by_name

    released = json.loads((CONFIGS / f"{name}.json").read_text())
    released = released.get("text_config", released)  # a multimodal checkpoint: its decoder's config
    model_type = released["model_type"]
    fields = {k: v for k, v in released.items() if not k.startswith("_") and k not in _NOT_FIELDS | {"model_type"}}
    fields = {k: (SIZES[k] if k in SIZES else shrink_by_name(k, v)) for k, v in fields.items()}
    if released.get("num_key_value_heads"):  # MHA stays MHA
        mha = released["num_key_value_heads"] == released.get("num_attention_heads")
        fields["num_key_value_heads"] = SIZES["num_attention_heads"] if mha else SIZES["num_key_value_heads"]
    fields.update({k: v for k, v in {**_SET, **MAMBA}.items() if k in fields})
    fields.update({k: 32 for k in _NARROWED if fields.get(k)})
    if "qk_rope_head_dim" in fields:  # MLA: consistent low-rank and head dims, no GQA
        fields.update({k: v for k, v in MLA.items() if k in fields or k == "head_dim"})
    if isinstance(fields.get("time_step_limit"), list):  # 1e308 (a copy's JSON for infinity) overflows fp32
        fields["time_step_limit"] = [
            v if abs(v) < 3.4e38 else math.copysign(math.inf, v) for v in fields["time_step_limit"]
        ]
    if "global_head_dim" in fields:  # the full layers' head dim comes from it, not tiny_configs' per-layer override
        fields["per_layer_config"] = {}
    fields = _shrunk_lengths(fields)
    if isinstance(fields.get("max_window_layers"), int):
        fields["max_window_layers"] = min(fields["max_window_layers"], 1)
    for key in ("layer_types", "hybrid_override_pattern"):
        if fields.get(key):
            fields[key] = _one_period(fields[key])
            fields["num_hidden_layers"] = len(fields[key])
    head_dim = fields.get("head_dim") or SIZES["head_dim"]
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(fields.get(key), dict):
            nested = all(isinstance(v, dict) for v in fields[key].values())
            fields[key] = (
                {k: _shrunk_rope(v, head_dim) for k, v in fields[key].items()}
                if nested
                else _shrunk_rope(fields[key], head_dim)
            )
    return model_type, fields


def run(rank: int, world_size: int, which=None) -> dict:
    """{name: the sweep's per-mode results} for the released configs (sweep_models.run_type)."""
    from easy_context.hf.architectures import check_model_type
    from tools import sweep_models

    results = {}
    for name in which or names():
        model_type, fields = shrunk(name)
        try:
            check_model_type(model_type)
        except ValueError as refusal:  # refused by name, with the record's reason
            results[name] = {"static": {"refused": str(refusal)}}
            continue
        try:
            results[name] = sweep_models.run_type(model_type, rank, world_size, **fields)
        except Exception as error:  # noqa: BLE001 - a result, like the sweep's
            results[name] = {"run": {"error": f"{type(error).__name__}: {error}"}}
    return results


def main() -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from ranks import run_ranks

    from tools import sweep_models

    results = run_ranks(run, 2, timeout=1800)[0]
    print("| checkpoint | type | class | features the sweep saw | reason or largest error |\n|---|---|---|---|---|")
    failing = 0
    for name, modes in results.items():
        found = sweep_models.classify(name, modes)
        failing += found[0] == "failing"
        features = ", ".join(modes.get("_features", ())) or "-"
        print(f"| {name} | `{shrunk(name)[0]}` | {found[0]} | {features} | {found[1][:120]} |")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
