"""Release 0.1's import paths keep working for one release: each old module name gives the new
module itself (so a monkeypatch through either name is seen by both), with a DeprecationWarning
that names the new path; the modes' old subpackages included, and `python -m easy_context.plan`."""

import importlib
import importlib.util
import sys
import warnings

import pytest

from easy_context.old_paths import MOVED, REMOVAL, OldPaths

# Names that were public in release 0.1, per old module: each must still be reachable there.
OLD_NAMES = {
    "api": ["apply_seq_parallel_monkey_patch", "prepare_seq_parallel_inputs", "gather_seq_parallel_outputs"],
    "kernels": ["attention_forward", "attention_backward", "select_backend", "available_backends"],
    "ring": ["ring_attention", "merge_block"],
    "masking": ["SequenceMask"],
    "layout": ["Layout"],
    "process_groups": ["get_groups", "Topology", "register_exit_teardown"],
    "zigzag_ring_attn": ["MODE", "zigzag_ring_attention"],
    "dist_flash_attn": ["MODE", "dist_flash_attention"],
    "dist_flash_attn.schedule": ["balanced_schedule"],
    "ulysses_attn": ["MODE", "ulysses_attention"],
    "usp_attn": ["MODE"],
    "data_parallel": ["MODE"],
    "generation": ["generate", "ShardedKVCache"],
    "trainer": ["prepare_trainer"],
    "replicas": ["check_replicas"],
    "architectures": ["SUPPORTED_MODEL_TYPES"],
    "launch": ["make_accelerator", "run_main"],
    "data": ["byte_tokenizer", "open_rows"],
    "plan": ["main"],
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_with_a_warning(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(f"easy_context.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"easy_context.{old}")
    assert module is new
    assert module.__name__ == new.__name__ and module.__spec__.name == new.__name__
    message = f"moved to {MOVED[old]}; the old path goes on {REMOVAL}"
    assert any(issubclass(w.category, DeprecationWarning) and message in str(w.message) for w in caught)
    for name in OLD_NAMES.get(old, []):
        assert hasattr(module, name), (old, name)


def test_every_old_name_with_public_names_is_listed():
    assert set(OLD_NAMES) <= set(MOVED)


def test_names_that_stayed_are_the_packages_themselves():
    from easy_context import hf, modes

    assert hf.active_patch is hf.active and hf.ActivePatch is hf.SequenceParallel
    assert callable(hf.install) and callable(hf.uninstall) and hf.world_size() == 1
    assert modes.get_mode("zigzag_ring_attn").name == "zigzag_ring_attn"


def test_python_m_old_planner_path_runs_the_new_package():
    # runpy runs a package's __main__: the alias must say "package" and the new one must have it
    for old in ("easy_context.plan", "easy_context.programs.plan"):
        spec = OldPaths().find_spec(old)
        assert spec is not None and spec.submodule_search_locations is not None
    assert importlib.util.find_spec("recipes.plan.__main__") is not None


@pytest.mark.parametrize("old", ["programs", "programs.launch", "programs.training.config", "programs.plan"])
def test_the_programs_package_is_the_recipes_package(old):
    # easy_context.programs moved out of the library: every module under it is recipes.<same>
    new = importlib.import_module("recipes" + old[len("programs") :])
    sys.modules.pop(f"easy_context.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"easy_context.{old}")
    assert module is new
    assert any(issubclass(w.category, DeprecationWarning) and new.__name__ in str(w.message) for w in caught)


def test_a_recipe_renamed_since_programs_is_found_by_its_old_name():
    # easy_context.programs.harness is recipes.lm_eval_model (renamed: "harness" also named the benchmarks' helpers)
    new = importlib.import_module("recipes.lm_eval_model")
    sys.modules.pop("easy_context.programs.harness", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("easy_context.programs.harness")
    assert module is new
    assert any(issubclass(w.category, DeprecationWarning) and new.__name__ in str(w.message) for w in caught)


def test_a_name_that_never_existed_is_not_found():
    assert OldPaths().find_spec("easy_context.programs.no_such_module") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("easy_context.no_such_module")
