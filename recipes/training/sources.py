"""Where train.py finds what the repository ships: the demo base (models/demo-base) and the model
shapes of configs/ (--from-config NAME)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ROOT", "DEMO_BASE", "CONFIGS", "SCRATCH_CONFIG", "config_path", "presets"]

ROOT = Path(__file__).resolve().parents[2]
DEMO_BASE = ROOT / "models" / "demo-base"  # scripts/pretrain_demo_base.py's model, shipped
CONFIGS = ROOT / "configs"  # --from-config NAME: configs/NAME/config.json (model shapes, no weights)
SCRATCH_CONFIG = CONFIGS / "tiny-llama"  # --from-scratch: --from-config tiny-llama


def config_path(name_or_path: str) -> Path | None:
    """--from-config's value as a config.json: a file, a folder holding one, or a shipped
    preset's name (configs/NAME/config.json); None where there is none."""
    for candidate in (Path(name_or_path), CONFIGS / name_or_path):
        if candidate.is_file():
            return candidate
        if (candidate / "config.json").is_file():
            return candidate / "config.json"
    return None


def presets() -> list[str]:
    return sorted(path.parent.name for path in CONFIGS.glob("*/config.json"))
