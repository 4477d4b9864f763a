"""Benchmarks of the plugin against stock vLLM. ``python -m
benchmarks`` (``__main__``) runs them and writes
BENCHMARKS.md.

``scheduler_cost`` times one scheduler step without a model. The others are
server-level benchmarks: a real vLLM OpenAI server with the plugin against
stock vLLM, side by side in one run, on the same tiny local model and load.

Every figure is a ratio of two measurements taken minutes (or seconds) apart
on the same machine, because the machines this runs on are shared and noisy;
absolute numbers are only context. No test asserts timings.

* ``throughput``: output throughput with limits configured far above demand
  (default 1e6 tok/s) against stock vLLM, alternating rounds, median ratio.
* ``idle``: CPU time of the engine-core process while only throttled
  requests are in flight, against the same plugin with its idle wait switched
  off (vLLM's own 1 ms loop, reproduced by a benchmark-only hook) and against
  stock vLLM decoding the same streams.
* ``isolation``: one light user beside a heavy user with many streams, with
  and without limits; the light user's tokens/s and TTFT beside the heavy one
  divided by the same alone.
* ``accuracy``: measured rate / limit for several limits and stream counts,
  client side and engine side (the scheduler's dispatch log), plus the gap
  between a user's consecutive tokens as the scheduler dispatched them.

Each server benchmark is a module of that name with a function
``name(pool, quick) -> dict``, its figure and a Markdown formatter
``format_name(results, figures_dir, md_dir) -> str``; ``__main__`` runs them
and writes BENCHMARKS.md. What they share: ``servers`` (the server
configurations and the pool that runs them), ``measure`` (process CPU, a
quiet machine, client-side token counts) and ``report_format`` (numbers,
verdicts and figures in the report).
"""
