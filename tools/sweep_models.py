#!/usr/bin/env python
"""Classify every causal-LM model type of the installed transformers under sequence parallelism.

    python -m tools.sweep_models                     # every type; prints the table
    python -m tools.sweep_models --types olmo3 phi   # some types
    python -m tools.sweep_models --check             # exit 1 where a type's class differs from
                                                     # easy_context/hf/architectures.py's record
    python -m tools.sweep_models --json sweep.json   # the classes and errors, for tools

Each type is one of:
- exact: its tiny model (tools/tiny_configs.py), patched, on 2 gloo ranks, in each mode family
  (zigzag ring, Ulysses, the LightSeq schedule; a hybrid's recurrent layers under both mixer
  strategies, state passing and head exchange), gives the unpatched single-process model's
  logits, loss and every parameter gradient, within the bounds of the architecture tests;
- refused: for a reason found without running it (`STATIC_REASONS`: encoder-decoder, encoder,
  multimodal wrapper, attention outside the registry, layers that are not attention), or
  because the patch itself refused it (an attention argument, a mask or a rope type it does not
  implement);
- failing: it ran and was not exact, or raised, or hung: a bug to fix or a refusal to write.

architectures.SUPPORTED is the list of exact types, architectures.REFUSED the reason of each
other type. `--check` holds that record to the sweep: a supported type must be exact, a type
refused for a static reason must be refused with that reason first in its record, and a type
recorded as refused for any other reason must still not be exact. A type the record does not
know is listed and refused at run time as untested; it fails --check only with --strict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback

from tools.exact_step import MODES, batch, errors, step

STALL_SECONDS = 90  # a type that runs this long without finishing is marked hung
MAX_PARAMETERS = 3_000_000  # a tiny config larger than this is a shrinking bug, not a model to run


# ------------------------------------------------------------------ static reasons
def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def static_reason(model_type: str) -> str | None:
    """Why a type cannot run sequence parallel, found from its config and modeling code alone."""
    import inspect

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from easy_context.hf import architectures
    from easy_context.hf import mixers as hf_mixers

    try:
        cls = causal_lm_class(model_type)
    except ImportError as error:
        return f"{architectures.NEEDS_LIBRARY}: {str(error).strip().splitlines()[0]}"
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - a default config that does not validate: the run will say why
        return None
    if getattr(config, "is_encoder_decoder", False):
        return f"{architectures.ENCODER_DECODER}: {cls.__name__} is the decoder of a sequence-to-sequence model"
    if config.get_text_config() is not config or hasattr(config, "text_config"):
        text = config.get_text_config()
        return f"{architectures.MULTIMODAL}: pass the model itself, or its decoder's type {text.model_type}"
    towers = sorted(k for k in config.to_dict() if k.endswith(("vision_config", "audio_config", "image_config")))
    if towers:
        return f"{architectures.MULTIMODAL}: {cls.__name__} holds its own encoders ({', '.join(towers)})"
    if "type_vocab_size" in config.to_dict():
        return f"{architectures.ENCODER}: {cls.__name__} is a BERT-style encoder run with a causal mask"
    unimplemented = architectures.unimplemented_attention(config)
    if unimplemented:
        return f"{architectures.NOT_IMPLEMENTED}: {unimplemented}"
    module = sys.modules[cls.__module__]
    mixers = architectures.sequence_mixers(module, config)
    if mixers and not hf_mixers.covers(module):
        unsupported = hf_mixers.unsupported_mixers(module)
        return f"{architectures.HYBRID}: {', '.join(unsupported or mixers)}"
    if "ALL_ATTENTION_FUNCTIONS" not in inspect.getsource(module) and not hf_mixers.covers(module):
        return f"{architectures.OUTSIDE_REGISTRY}: {cls.__name__} computes attention itself"
    return None


# ---------------------------------------------------------------------- one rank
def tiny_model(model_type: str, **overrides):
    """The type's tiny model (tools/tiny_configs.py), with config fields `overrides` set."""
    import torch

    from easy_context.hf.architectures import attn_implementation
    from tools.tiny_configs import tiny_config

    config = tiny_config(model_type, **overrides)
    cls = causal_lm_class(model_type)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise RuntimeError(f"the tiny config has {size} parameters (> {MAX_PARAMETERS}): shrink it in tiny_configs")
    torch.manual_seed(0)
    config._attn_implementation = attn_implementation(config)
    model = cls(config).float()
    with torch.no_grad():  # parameters initialised to constants (sinks: zeros) get values that matter
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    return model


def features(model) -> list[str]:
    """What a model adds to Llama's attention, read from its config and modules (for the record)."""
    config = model.config.get_text_config()
    found = []
    kinds = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" in kinds and "full_attention" in kinds:
        found.append("alternating sliding / global layers")
    elif getattr(config, "sliding_window", None):
        found.append("sliding window")
    if getattr(config, "attn_logit_softcapping", None):
        found.append("logit softcapping")
    names = [name for name, _ in model.named_parameters()]
    if any(name.endswith("sinks") for name in names):
        found.append("attention sinks")
    if getattr(config, "kv_lora_rank", None):
        found.append("MLA")
    if any(".q_norm." in name or ".k_norm." in name for name in names):
        found.append("QK norm")
    if any("expert" in name for name in names):
        found.append("mixture of experts")
    if getattr(config, "rope_parameters", None) in (None, {}) and any(
        "embed_positions" in n or "wpe" in n for n in names
    ):
        found.append("learned absolute positions")
    module = sys.modules[type(model).__module__]
    if hasattr(module, "mamba2_scan_forward"):
        found.append("Mamba-2 layers")
    elif hasattr(module, "torch_chunk_gated_delta_rule"):
        found.append("Gated DeltaNet layers")
    elif any(name.endswith(("ShortConv", "ShortConvolution")) for name in vars(module)):
        found.append("short convolution layers")
    return found


@contextlib.contextmanager
def admitted(model_type: str):
    """The patch takes `model_type` as if it were supported (the sweep decides whether it is)."""
    from easy_context.hf import architectures

    saved = architectures.SUPPORTED.get(model_type), architectures.REFUSED.pop(model_type, None)
    architectures.SUPPORTED[model_type] = ()
    try:
        yield
    finally:
        del architectures.SUPPORTED[model_type]
        if saved[0] is not None:
            architectures.SUPPORTED[model_type] = saved[0]
        if saved[1] is not None:
            architectures.REFUSED[model_type] = saved[1]


def _refusal(error: BaseException) -> str | None:
    """The message of a ValueError raised by easy_context (the patch refusing), else None."""
    if not isinstance(error, ValueError):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    return str(error) if frames and f"{os.sep}easy_context{os.sep}" in frames[-1].filename else None


def run_type(model_type: str, rank: int, world_size: int, modes=MODES, **overrides) -> dict:
    """{mode: [logits, loss, grad errors] | {"refused": message} | {"error": message}}, for the
    type's tiny model with config fields `overrides` set, in `modes`."""
    import copy

    from easy_context import (
        apply_seq_parallel_monkey_patch,
        gather_seq_parallel_outputs,
        prepare_seq_parallel_inputs,
        remove_seq_parallel_monkey_patch,
    )
    from easy_context.hf import active_patch
    from easy_context.hf import mixers as hf_mixers
    from easy_context.mixers import STRATEGIES

    input_ids, target_ids = batch()
    try:  # on every rank, so that every rank stops here alike when the model cannot run at all
        model = tiny_model(model_type, **overrides)
        want = step(copy.deepcopy(model), input_ids, None, target_ids, None)
    except Exception as error:  # noqa: BLE001 - every failure is a result here
        return {"unpatched": {"error": f"{type(error).__name__}: {error}"}}
    try:
        truth = step(copy.deepcopy(model).double(), input_ids, None, target_ids, None)
        truth = (truth[0].float(), truth[1], {name: g.float() for name, g in truth[2].items()})
    except Exception:  # noqa: BLE001 - a model that cannot run in fp64 is held to the fixed bounds
        truth = None
    results = {"_features": features(model)}
    scans = hf_mixers.has_scans(sys.modules[type(model).__module__])
    # a hybrid's recurrent layers under each strategy (mixers/): every mode runs both
    runs = [(mode, strategy) for mode in modes for strategy in (STRATEGIES if scans else (None,))]
    for mode, strategy in runs:
        key = mode if strategy is None else f"{mode}+{strategy}"
        try:
            with admitted(model.config.model_type):
                patched = copy.deepcopy(model)
                apply_seq_parallel_monkey_patch(mode, patched, mixer_strategy=strategy)
                group = active_patch().groups().sp
                local = prepare_seq_parallel_inputs(mode, input_ids, None, target_ids, rank, world_size, "cpu")
                got = step(
                    patched, local["local_input_ids"], local["local_position_ids"], local["local_target_ids"], group
                )
                logits = gather_seq_parallel_outputs(mode, got[0])
                results[key] = list(errors((logits, *got[1:]), want, truth))
        except Exception as error:  # noqa: BLE001
            refusal = _refusal(error)
            results[key] = {"refused": refusal} if refusal else {"error": f"{type(error).__name__}: {error}"}
        finally:
            remove_seq_parallel_monkey_patch()
    exact_so_far = all(isinstance(r, list) for key, r in results.items() if not key.startswith("_"))
    if hf_mixers.covers(sys.modules[type(model).__module__]) and exact_so_far and modes == MODES:
        from tools import hybrid_checks

        try:  # packed documents and generation (tools/hybrid_checks.py)
            with admitted(model.config.model_type):
                results.update(hybrid_checks.run(model, rank, world_size))
        except Exception as error:  # noqa: BLE001
            results["hybrid checks"] = {"error": f"{type(error).__name__}: {error}"}
    return results


# ------------------------------------------------------------------ variants
# A variant of a type is its tiny config with fields a user's config may set (issue 56): a
# window set or unset (all mode families: the mask is what changes), each rope type (one mode:
# the positions are what changes, the same in every mode). Entries are named "<type>+<variant>".
VARIANT_SEPARATOR = "+"
ROPE_MODES = ("zigzag_ring_attn",)
ROPE_ORIGINAL = 64  # the rope's original context: the sweep's SEQ crosses it


def variants(model_type: str, rope_types=None) -> dict:
    """{entry name: (config overrides, modes)} of a type's variants (rope_types: those rope
    types only; None: every one)."""
    from tools.tiny_configs import rope_variants, window_variants

    found = {f"{model_type}{VARIANT_SEPARATOR}{n}": (o, MODES) for n, o in window_variants(model_type).items()}
    for name, overrides in rope_variants(model_type, ROPE_ORIGINAL).items():
        if rope_types is None or name.removeprefix("rope=") in rope_types:
            found[f"{model_type}{VARIANT_SEPARATOR}{name}"] = (overrides, ROPE_MODES)
    return found


def run_entry(entry: str, rank: int, world_size: int) -> dict:
    """run_type for a type or one of its variants."""
    model_type = entry.split(VARIANT_SEPARATOR)[0]
    if entry == model_type:
        return run_type(model_type, rank, world_size)
    overrides, modes = variants(model_type)[entry]
    return run_type(model_type, rank, world_size, modes=modes, **overrides)


def _rank_entry(rank, world_size, workdir, types):
    import datetime
    import warnings

    import torch
    import torch.distributed as dist
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=STALL_SECONDS * 4),
    )
    with open(f"{workdir}/rank{rank}.jsonl", "a") as log:
        for model_type in types:
            log.write(json.dumps({"start": model_type}) + "\n")
            log.flush()
            log.write(json.dumps({"type": model_type, "modes": run_entry(model_type, rank, world_size)}) + "\n")
            log.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # results are on disk; skip an interpreter teardown that gloo's threads may abort


def _read(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_dynamic(types: list[str], world_size: int = 2, stall: float = STALL_SECONDS, echo=print) -> dict:
    """{type: {mode: result}} over `world_size` spawned gloo ranks; a stalled or crashed run is
    killed, its current type marked, and the rest run in fresh ranks."""
    results, remaining = {}, list(types)
    ctx = mp.get_context("spawn")
    while remaining:
        with tempfile.TemporaryDirectory() as workdir:
            procs = [
                ctx.Process(target=_rank_entry, args=(r, world_size, workdir, remaining)) for r in range(world_size)
            ]
            for p in procs:
                p.start()
            last, seen = time.monotonic(), 0
            while any(p.is_alive() for p in procs):
                time.sleep(0.5)
                lines = _read(f"{workdir}/rank0.jsonl")
                if len(lines) != seen:
                    seen, last = len(lines), time.monotonic()
                    for line in lines:
                        if "type" in line and line["type"] not in results:
                            results[line["type"]] = line["modes"]
                            echo(f"  {line['type']}: {summary(classify(line['type'], line['modes']))}")
                crashed = any(p.exitcode not in (None, 0) for p in procs)
                if crashed or time.monotonic() - last > stall:
                    break
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            lines = _read(f"{workdir}/rank0.jsonl")
            for line in lines:
                if "type" in line:
                    results.setdefault(line["type"], line["modes"])
            started = [line["start"] for line in lines if "start" in line]
            current = started[-1] if started else remaining[0]
            if current not in results:
                codes = [p.exitcode for p in procs]
                results[current] = {"run": {"error": f"the ranks hung or crashed here (exit codes {codes})"}}
                echo(f"  {current}: {summary(classify(current, results[current]))}")
            remaining = [t for t in remaining if t not in results]
    return results


# ------------------------------------------------------------------------ classes
NOT_ACCEPTED = "not accepted"  # a variant the unpatched model itself does not run


def classify(model_type: str, modes: dict) -> tuple[str, str]:
    """(class, why) from one type's results: exact, refused (by the patch) or failing; a variant
    whose unpatched model does not run is one its type's config does not accept."""
    if VARIANT_SEPARATOR in model_type and "error" in modes.get("unpatched", {}):
        return NOT_ACCEPTED, modes["unpatched"]["error"]
    errors, refusals, worst = [], [], [0.0, 0.0, 0.0, 0.0]
    for mode, result in modes.items():
        if mode.startswith("_"):
            continue
        if isinstance(result, dict):
            (refusals if "refused" in result else errors).append(f"{mode}: {result.get('refused') or result['error']}")
        else:
            worst = [max(a, b) for a, b in zip(worst, result)]
    if errors:
        return "failing", errors[0]
    if refusals:
        return "refused", refusals[0].split(": ", 1)[1]
    errors = f"logits {worst[0]:.1e}, loss {worst[1]:.1e}, grads {worst[2]:.1e} ({worst[3]:.2f} of the bound)"
    return ("exact", errors) if worst[3] <= 1.0 else ("failing", f"not exact: {errors}")


def summary(found: tuple[str, str]) -> str:
    return f"{found[0]} ({found[1][:160]})"


def sweep(types: list[str], world_size: int = 2, echo=print) -> tuple[dict, dict]:
    """({type: (class, why)}, {type: per-mode results of those that ran}) for `types`: the
    static reasons first, the rest run."""
    found, dynamic = {}, []
    for model_type in types:
        reason = None if VARIANT_SEPARATOR in model_type else static_reason(model_type)
        if reason is None:
            dynamic.append(model_type)
        else:
            found[model_type] = ("refused", reason)
    echo(f"{len(found)} types refused from their code and config; running {len(dynamic)} on {world_size} ranks")
    ran = run_dynamic(dynamic, world_size, echo=echo)
    # On a loaded CPU torch's fp32 exp was seen off by 1.5e-4, rarely (tests/conftest.py's
    # NUMERIC): a type that ran but was not exact runs once more, and fails if it fails twice.
    again = [t for t, modes in ran.items() if classify(t, modes)[1].startswith("not exact")]
    if again:
        echo(f"running {again} once more (not exact on the first run)")
        ran.update(run_dynamic(again, world_size, echo=echo))
    for model_type, modes in ran.items():
        found[model_type] = classify(model_type, modes)
    return dict(sorted(found.items())), ran


def mismatches(found: dict, strict: bool = False) -> list[str]:
    """Where the sweep and architectures.py's record disagree (see the module docstring)."""
    from easy_context.hf import architectures

    problems = []
    for model_type, (cls, why) in found.items():
        if VARIANT_SEPARATOR in model_type:  # a variant of a supported type: exact or refused by name
            if cls == "failing":
                problems.append(f"{model_type}: a variant of a supported type, failing: {why[:300]}")
            continue
        recorded = architectures.SUPPORTED.get(model_type), architectures.REFUSED.get(model_type)
        if recorded == (None, None):
            if strict or cls == "exact":
                problems.append(f"{model_type}: {cls} ({why[:120]}) but not in the record")
            continue
        if recorded[0] is not None and cls != "exact":
            problems.append(f"{model_type}: supported in the record but {cls}: {why[:300]}")
        elif recorded[1] is not None:
            if cls == "exact":
                problems.append(f"{model_type}: exact now ({why}); move it to SUPPORTED")
            elif static_reason_category(why) and not recorded[1].startswith(static_reason_category(why)):
                problems.append(f"{model_type}: refused for {why!r}, recorded as {recorded[1]!r}")
    return problems


def suggestions(found: dict, dynamic: dict) -> list[str]:
    """Record entries (architectures.SUPPORTED / REFUSED) for types whose class the record does
    not have yet: paste them, editing a failing type's reason into why it is refused."""
    from easy_context.hf import architectures

    lines = []
    for model_type, (cls, why) in found.items():
        if cls == "exact" and model_type not in architectures.SUPPORTED:
            lines.append(f"SUPPORTED {model_type!r}: {tuple(dynamic.get(model_type, {}).get('_features', ()))},")
        elif cls != "exact" and model_type not in architectures.REFUSED:
            lines.append(f"REFUSED   {model_type!r}: {why[:200]!r},")
    return lines


def static_reason_category(why: str) -> str | None:
    from easy_context.hf import architectures

    for category in architectures.REFUSAL_CATEGORIES:
        if why.startswith(category):
            return category
    return None


def markdown(found: dict) -> str:
    """The types' table, then (with variants) a table of each variant's classes over the types."""
    lines = ["| model type | class | reason or largest error |", "|---|---|---|"]
    lines += [
        f"| `{t}` | {cls} | {why.replace('|', '/')[:200]} |"
        for t, (cls, why) in found.items()
        if VARIANT_SEPARATOR not in t
    ]
    kinds: dict = {}
    for entry, (cls, _) in found.items():
        if VARIANT_SEPARATOR in entry:
            model_type, kind = entry.split(VARIANT_SEPARATOR, 1)
            kinds.setdefault(kind, {}).setdefault(cls, []).append(model_type)
    if kinds:
        classes = ("exact", "refused", NOT_ACCEPTED, "failing")
        lines += [
            "",
            f"| variant | {' | '.join(classes)} | refused or failing |",
            "|---|" + "---|" * (len(classes) + 1),
        ]
        for kind, by_class in sorted(kinds.items()):
            counts = " | ".join(str(len(by_class.get(cls, []))) for cls in classes)
            others = sorted(t for cls in ("refused", "failing") for t in by_class.get(cls, []))
            lines.append(f"| {kind} | {counts} | {', '.join(others) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", help="model types to sweep (default: every causal-LM type)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--check", action="store_true", help="exit 1 where a class differs from the record")
    parser.add_argument("--strict", action="store_true", help="with --check: a type the record lacks fails too")
    parser.add_argument("--json", help="write {type: [class, why]} here")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="also each supported type's variants: a window set and unset, each rope type (<type>+<variant>)",
    )
    parser.add_argument("--rope-types", nargs="+", help="with --variants: these rope types only (default: all)")
    parser.add_argument("--suggest", action="store_true", help="print record entries for types the record lacks")
    args = parser.parse_args(argv)
    types = args.types or causal_lm_types()
    unknown = sorted(set(types) - set(causal_lm_types()))
    if unknown:
        parser.error(f"not causal-LM model types of this transformers: {unknown}")
    if args.variants:
        from easy_context.hf.architectures import SUPPORTED

        types = types + [entry for t in types if t in SUPPORTED for entry in variants(t, args.rope_types)]
    start = time.monotonic()
    found, ran = sweep(types, args.ranks)
    print(markdown(found))
    counts = {
        cls: sum(1 for c, _ in found.values() if c == cls) for cls in ("exact", "refused", "failing", NOT_ACCEPTED)
    }
    print(f"\n{counts} of {len(found)} types in {time.monotonic() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    if args.suggest:
        print("\n".join(suggestions(found, ran)))
    if args.check:
        problems = mismatches(found, args.strict)
        for problem in problems:
            print("MISMATCH", problem)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
