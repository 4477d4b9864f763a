"""The built distributions hold the plugin and what users run, nothing else.

``python -m build`` (what ``make dist`` runs) builds the sdist first and then
the wheel from that sdist, so one build checks that both build. The wheel is
then installed with ``--no-deps`` into an empty virtual environment, and what
that environment sees (files, entry points, importable top-level names) is
what is checked: a user's ``pip install`` gets exactly that. Building takes
about 15 s, once per session.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tarfile
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "vllm_output_rate"
SOURCE = REPO / "src" / PACKAGE
ENTRY_POINTS = {
    ("console_scripts", "vllm-output-rate"): "vllm_output_rate.cli:main",
    (
        "vllm.general_plugins",
        "output_rate",
    ): "vllm_output_rate.integration.plugin:register",
    (
        "vllm.endpoint_plugins",
        "output_rate_http",
    ): "vllm_output_rate.integration.http_plugin:OutputRateHttpPlugin",
}
# Benchmarks and test harnesses live in the checkout only.
NEVER_SHIPPED = ("benchmarks", "harness", "scheduler_sim", "fake_clock", "tests")
# Run inside the empty environment: what an installed wheel looks like.
INSPECT = """
import importlib.metadata as md, importlib.util as iu, json
dist = md.distribution("vllm-output-rate")
print(json.dumps({
    "files": sorted(str(f) for f in dist.files),
    "entry_points": sorted([e.group, e.name, e.value] for e in dist.entry_points),
    "license": dist.metadata["License-Expression"],
    "origin": iu.find_spec("vllm_output_rate").origin,
    "importable": {n: iu.find_spec(n) is not None for n in %r},
}))
"""


@dataclass(frozen=True)
class Build:
    wheel: Path
    sdist: Path
    log: str


def source_modules() -> set[str]:
    """Every module of the package, as a path inside the wheel."""
    return {
        f"{PACKAGE}/{path.relative_to(SOURCE).as_posix()}"
        for path in SOURCE.rglob("*.py")
    }


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Build:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(out.iterdir())
    return Build(wheel=wheels[0], sdist=sdists[0], log=log)


@pytest.fixture(scope="session")
def installed(built: Build, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What an empty virtual environment holding only the wheel sees."""
    env = tmp_path_factory.mktemp("env")
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run(
        [*pip, "install", "--quiet", "--no-deps", "--no-index", str(built.wheel)],
        check=True,
        timeout=300,
    )
    proc = subprocess.run(
        # -I: neither the working directory nor PYTHONPATH on sys.path.
        [str(python), "-I", "-c", INSPECT % (NEVER_SHIPPED,)],
        cwd=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict = json.loads(proc.stdout)
    result["env"] = str(env)
    return result


def test_the_build_has_no_packaging_warnings(built: Build) -> None:
    warnings = [line for line in built.log.splitlines() if "warning" in line.lower()]
    assert not [line for line in warnings if "license" in line.lower()], warnings


def test_the_wheel_holds_the_package_and_its_metadata_only(built: Build) -> None:
    names = zipfile.ZipFile(built.wheel).namelist()
    modules = {n for n in names if n.startswith(f"{PACKAGE}/")}
    metadata = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    assert set(names) == modules | metadata
    assert modules == source_modules()
    assert not [n for n in names for bad in NEVER_SHIPPED if bad in n]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in metadata)


def test_an_empty_environment_gets_only_the_plugin(installed: dict) -> None:
    env = Path(installed["env"])
    site_packages = next(env.glob("lib/python*/site-packages"))
    assert Path(installed["origin"]).is_relative_to(site_packages)
    installed_modules = {
        f for f in installed["files"] if f.startswith(f"{PACKAGE}/")
    } - {f for f in installed["files"] if "__pycache__" in f}
    assert installed_modules == source_modules()
    tops = {f.split("/")[0] for f in installed["files"]}
    assert {t for t in tops if not t.endswith(".dist-info")} <= {PACKAGE, ".."}
    assert installed["importable"] == dict.fromkeys(NEVER_SHIPPED, False)
    assert installed["license"] == "Apache-2.0"
    assert (env / "bin" / "vllm-output-rate").exists()


def test_the_entry_points_are_declared_and_resolve(installed: dict) -> None:
    declared = {(g, n): v for g, n, v in installed["entry_points"]}
    assert declared == ENTRY_POINTS
    for target in declared.values():
        module, _, attribute = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute))


def test_the_sdist_holds_what_builds_the_wheel(built: Build) -> None:
    with tarfile.open(built.sdist) as sdist:
        names = sdist.getnames()
    root = names[0].split("/")[0]
    assert root.startswith("vllm_output_rate-")
    inside = {n.removeprefix(f"{root}/") for n in names if n != root}
    for required in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        assert required in inside, required
    assert {f"src/{m}" for m in source_modules()} <= inside
    assert not [n for n in inside if n.split("/")[0] in ("tests", "benchmarks")]
