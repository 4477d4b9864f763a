"""Check the seams declared in ``seams.py`` against a vLLM.

* ``verify_seams()`` raises ``SeamMovedError`` naming every declared
  internal that the installed vLLM (or a given source) lacks or changed; the
  plugin runs it when it loads, the HTTP plugin with ``api=True``.
* ``check_host(scheduler)`` raises unless a real scheduler has every
  attribute of ``seams.SchedulerHost``; our scheduler runs it when it starts.
* ``seam_problems(source)`` lists the problems, for either reader of
  ``vllm_source.py``: the installed vLLM, or a source tree never imported.
* ``main``: ``python -m vllm_output_rate.seams [DIR]`` (``make vllm-next``).

vLLM is imported only inside these checks.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from vllm_output_rate import seams
from vllm_output_rate.seams_facts import SOURCE_FACTS
from vllm_output_rate.vllm_source import LiveSource, Source, StaticSource, vllm_imports

# Every `from vllm... import name` of this package must resolve.
PACKAGE_DIR = Path(__file__).parent


def check_host(scheduler: object) -> None:
    """Raise ``SeamMovedError`` unless ``scheduler`` has every declared attribute."""
    missing = [name for name in seams.HOST_ATTRIBUTES if not hasattr(scheduler, name)]
    if missing:
        raise seams.SeamMovedError(
            "vllm-output-rate cannot hook into this vLLM: its Scheduler has no "
            + ", ".join(missing)
        )


def seam_problems(
    source: Source,
    *,
    api: bool = True,
    imports: bool = True,
    also_imports_of: tuple[str | Path, ...] = (),
) -> list[str]:
    """Every internal this plugin relies on that ``source`` lacks or changed.

    ``api=False`` skips the OpenAI request classes (engine processes never
    import the API server); ``imports=False`` skips checking that every vLLM
    name this package imports exists (at start-up Python checks the ones
    it needs as it imports them); ``also_imports_of`` adds folders whose
    vLLM imports must resolve too (the tests).
    """
    problems = []
    init = source.function(seams.SCHEDULER_MODULE, "Scheduler.__init__")
    for name in seams.HOST_ATTRIBUTES:
        # Assigned (perhaps annotated) in vLLM's Scheduler.__init__.
        if init is None or not any(
            f"self.{name}{end}" in init.source for end in (" =", ":")
        ):
            problems.append(f"no longer true: Scheduler keeps {name}")
    request_init = source.function("vllm.v1.request", "Request.__init__")
    for name in seams.REQUEST_FIELDS:
        if request_init is None or not any(
            f"self.{name}{end}" in request_init.source for end in (" =", ":")
        ):
            problems.append(f"no longer true: Request keeps {name}")
    for module, path, params in seams.EXPECTED_SIGNATURES:
        function = source.function(module, path)
        if function is None:
            problems.append(f"{module}.{path} no longer exists")
            continue
        names = function.params
        if params not in (names[: len(params)], names[1 : len(params) + 1]):
            problems.append(f"{module}.{path}{tuple(names)} expected {params}")
    methods = [(cls, "to_sampling_params") for cls in seams.REQUEST_CLASSES]
    methods += [(cls, "to_beam_search_params") for cls in seams.BEAM_SEARCH_CLASSES]
    for (module, name), method in methods if api else []:
        if source.function(module, f"{name}.{method}") is None:
            problems.append(f"{module}.{name}.{method} no longer exists")
    for module, path, needle, fact in SOURCE_FACTS:
        function = source.function(module, path)
        if function is None or needle not in function.source:
            problems.append(f"no longer true: {fact}")
    if api and isinstance(source, LiveSource):
        problems += _funnel_problems()
        try:
            seams.api_key_guarded_prefixes()
        except (ImportError, AttributeError):
            problems.append(f"{'.'.join(seams.API_KEY_GUARD)} no longer exists")
        except seams.SeamMovedError as exc:
            problems.append(str(exc))
    for need in vllm_imports(PACKAGE_DIR, *also_imports_of) if imports else []:
        if not any(
            all(
                source.defines(module, name) if name else source.has_module(module)
                for module, name in option
            )
            for option in need.options
        ):
            problems.append(need.describe())
    return problems


def verify_seams(
    *, api: bool = True, imports: bool = False, source: Source | None = None
) -> None:
    """Raise ``SeamMovedError`` naming every internal that is gone or changed
    (in the installed vLLM unless ``source`` says otherwise)."""
    problems = seam_problems(source or LiveSource(), api=api, imports=imports)
    if problems:
        raise seams.SeamMovedError(
            "vllm-output-rate cannot hook into this vLLM: " + "; ".join(problems)
        )


def _funnel_problems() -> list[str]:
    """Every path of the engine client into the engine core goes through
    ``seams.FUNNEL`` (so that no route can bypass trusted identity)."""
    module, name = seams.ENGINE_CLIENT
    where = f"{module}.{name}"
    try:
        client = seams.resolve(module, name)
        funnel = getattr(client, seams.FUNNEL)
    except (ImportError, AttributeError):
        return [f"{where}.{seams.FUNNEL} no longer exists"]
    problems = []
    names = list(inspect.signature(inspect.unwrap(funnel)).parameters)
    if names[: len(seams.FUNNEL_PARAMS)] != seams.FUNNEL_PARAMS:
        problems.append(
            f"{where}.{seams.FUNNEL}{tuple(names)} expected {seams.FUNNEL_PARAMS}"
        )
    sources = {
        attr: inspect.getsource(value)
        for attr, value in vars(client).items()
        if inspect.isfunction(value)
    }
    for call, allowed in seams.ENGINE_ENTRY_CALLERS.items():
        callers = {attr for attr, source in sources.items() if call in source}
        if not callers & allowed:
            problems.append(f"no longer true: {where} sends requests by {call}...)")
        for caller in sorted(callers - allowed):
            problems.append(
                f"{where}.{caller} calls {call}...) outside {where}.{seams.FUNNEL}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_output_rate.seams [DIR]``: check the installed vLLM,
    or the vLLM source tree in DIR (e.g. an unpacked wheel of a release
    that cannot run here)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vllm_output_rate.seams")
    parser.add_argument(
        "vllm_source",
        nargs="?",
        help="folder holding the vllm package (default: installed)",
    )
    args = parser.parse_args(argv)
    source = StaticSource(args.vllm_source) if args.vllm_source else LiveSource()
    problems = seam_problems(source)
    for problem in problems:
        print(f"MOVED: {problem}")
    checked = (
        len(seams.EXPECTED_SIGNATURES)
        + len(SOURCE_FACTS)
        + len(seams.HOST_ATTRIBUTES)
        + len(seams.REQUEST_CLASSES)
        + len(seams.BEAM_SEARCH_CLASSES)
    )
    print(
        f"{source.name}: {len(problems)} problem(s) in {checked} seams and "
        f"{len(vllm_imports(PACKAGE_DIR))} imports"
    )
    return 1 if problems else 0
