"""Presenting: the raw results of a run (``results.json``, made by
``benchmarks.suite``) as BENCHMARKS.md and its figures in ``docs/bench/``.
Nothing here measures; everything here reads only the results dict, so a
report can be re-rendered from a past run's ``results.json``
(``python -m benchmarks --from-results PATH``).

``document`` assembles the file; one module per benchmark (``throughput``,
``scheduler_cost``, ``idle``, ``isolation``, ``accuracy``, ``metrics_scrape``,
``store``, ``speculative``) gives its
``TITLE``, its ``summary_rows`` and its ``section`` (Markdown, with its
figures); ``markdown`` and ``figures`` hold what they share; ``history.md``
is the hand-kept history table the document ends with.
"""
