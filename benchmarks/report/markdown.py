"""Small pieces of the report's Markdown: numbers (``fmt``, shared with the
progress lines), verdicts, figure links."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.progress import fmt

__all__ = ["fmt", "image", "relative", "verdict"]


def verdict(met: bool | None) -> str:
    if met is None:
        return "n.a."
    return "met" if met else "**missed**"


def relative(path: Path, md_dir: Path) -> str:
    """``path`` as a link from a Markdown file in ``md_dir``."""
    return Path(os.path.relpath(path, md_dir)).as_posix()


def image(alt: str, path: Path, md_dir: Path) -> list[str]:
    """The lines that show a figure written at ``path``."""
    return [f"![{alt}]({relative(path, md_dir)})", ""]
