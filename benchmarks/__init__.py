"""Benchmarks of the plugin against stock vLLM (not installed; run from a
checkout by ``make bench``, i.e. ``python -m benchmarks``, which keeps the
results in ``benchmarks/results/`` and writes BENCHMARKS.md and
``docs/bench/*.png`` from them).

Every figure is a ratio of two measurements taken side by side on the same
machine, because the machines this runs on are shared and noisy.

Measuring, one module per section (each returns JSON-able results):
``scheduler_cost`` (one scheduler step without a model; its workload:
``scheduler_workload``), ``engine_throughput`` (paired rounds of two
engines, for every pair in ``kinds``), ``isolation``, ``accuracy`` (on the
servers of ``servers``), ``store``, ``speculative`` and ``fair_shares``
(with ``batch_changes``). ``suite`` runs a selection in order; ``results``
keeps what they measured. Shared: ``measure`` (statistics, token counts,
progress lines), ``noise`` (how busy the rest of the machine is), ``hooks``
and ``step_timing`` (benchmark-only ``sitecustomize`` hooks in an engine's
processes), ``checkout`` (the repository they run from).

Presenting: ``report/`` turns kept results into BENCHMARKS.md and its
figures; it imports no measuring module (``tests/benchmarks/test_imports.py``).
"""
