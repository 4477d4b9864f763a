"""Presenting: the kept results (``benchmarks/results/latest.json``) as
BENCHMARKS.md and its figures in ``docs/bench/``. Nothing here measures, and
nothing here imports a measuring module: every function reads results dicts.

``document`` assembles the file; one module per section (``throughput``,
``scheduler_cost``, ``isolation``, ``accuracy``, ``store``, ``speculative``,
``fair_shares``) gives its ``TITLE``, ``summary_rows``, ``headlines`` and
``section``; ``history`` renders the history table; ``format`` holds what
they share.
"""
