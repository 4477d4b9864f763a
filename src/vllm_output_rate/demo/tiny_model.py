"""Build the tiny model once and cache it: ``build_tiny_model()``.

The model (``tiny_model_recipe.py``) is built into a folder named after its
variant and recipe version, under ``$VLLM_OUTPUT_RATE_CACHE`` or the XDG
cache (``default_model_path``). A folder counts as built only with a marker
holding the recipe's hash, written last; a build happens in a private
sibling folder and is installed by an atomic rename, so concurrent builders
and readers never see half a model. A build of the same recipe is reused.

Usage::

    python -m vllm_output_rate.demo.tiny_model [--variant V] [--path P] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from vllm_output_rate.demo.tiny_model_recipe import (
    DEFAULT_VARIANT,
    FORMAT_VERSION,
    VARIANTS,
    check_variant,
    save_model,
    spec_hash,
    token_ids,
    train_tokenizer,
)

MODEL_DIRNAME = f"tiny-llama-v{FORMAT_VERSION}"
MARKER_NAME = ".complete"


def _dirname(variant: str) -> str:
    if variant == DEFAULT_VARIANT:
        return MODEL_DIRNAME
    return f"tiny-{variant}-v{FORMAT_VERSION}"


def default_model_path(variant: str = DEFAULT_VARIANT) -> Path:
    """Where the model lives when no path is given.

    ``$VLLM_OUTPUT_RATE_CACHE`` wins so tests and CI can isolate the cache;
    otherwise follow the XDG base-directory convention (empty means unset).
    """
    dirname = _dirname(check_variant(variant))
    override = os.environ.get("VLLM_OUTPUT_RATE_CACHE")
    if override:
        return Path(override).expanduser() / dirname
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "vllm-output-rate" / dirname


def is_complete(path: Path, variant: str = DEFAULT_VARIANT) -> bool:
    """True if ``path`` holds a finished build of the current recipe."""
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("spec_hash") == spec_hash(variant)


def _file_digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _write_marker(directory: Path, variant: str) -> None:
    # Written last: its presence is what makes a folder count as complete.
    marker = {"spec_hash": spec_hash(variant), "files": _file_digests(directory)}
    (directory / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True))


def _build_into(directory: Path, variant: str) -> None:
    vision = VARIANTS[variant].get("vision")
    if vision is not None:
        from vllm_output_rate.demo.tiny_vision import save_vision_model

        save_vision_model(directory, vision)
        _write_marker(directory, variant)
        return
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(directory)
    save_model(directory, len(tokenizer), token_ids(tokenizer), variant)
    _write_marker(directory, variant)


def _discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _install(staging: Path, target: Path, *, force: bool, variant: str) -> None:
    """Move a finished ``staging`` folder to ``target`` by rename.

    A rename is atomic, so no reader ever sees a half-written folder (while a
    forced rebuild swaps folders there is briefly none, and a reader then
    builds its own).  If another process installed a complete build first,
    keep theirs (unless forced): both are identical anyway.
    """
    last_error: OSError | None = None
    for _ in range(3):
        try:
            staging.rename(target)  # fails if target exists and is not empty
            return
        except OSError as exc:
            last_error = exc
        if is_complete(target, variant) and not force:
            _discard(staging)
            return
        # Stale, incomplete or forced: move it aside, then retry the rename.
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        with contextlib.suppress(FileNotFoundError):
            target.rename(trash / target.name)
        _discard(trash)
    raise RuntimeError(f"could not install tiny model at {target}") from last_error


def build_tiny_model(
    path: Path | None = None,
    *,
    force: bool = False,
    variant: str = DEFAULT_VARIANT,
) -> Path:
    """Build the tiny model at ``path`` (default: ``default_model_path()``).

    Returns the model folder.  Does nothing if a complete build of the same
    recipe is already there, unless ``force`` is true.
    """
    check_variant(variant)
    target = Path(path) if path is not None else default_model_path(variant)
    if not force and is_complete(target, variant):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # A sibling on the same filesystem, so the final rename is atomic; a
    # unique name, so concurrent builders never write into the same folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp makes the folder private (0700); a shared cache should be readable.
    staging.chmod(0o755)
    try:
        _build_into(staging, variant)
        _install(staging, target, force=force, variant=variant)
    finally:
        _discard(staging)  # no-op after a successful rename
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_output_rate.demo.tiny_model",
        description="Build (if needed) the tiny test model and print its path.",
    )
    parser.add_argument("--path", type=Path, default=None, help="model folder")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument(
        "--variant", choices=sorted(VARIANTS), default=DEFAULT_VARIANT, help="model"
    )
    args = parser.parse_args(argv)
    print(build_tiny_model(args.path, force=args.force, variant=args.variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
