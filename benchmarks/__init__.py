"""Benchmarks of the plugin against stock vLLM (not installed; run from a
checkout by ``make bench``, i.e. ``python -m benchmarks``, which writes
BENCHMARKS.md and ``docs/bench/*.png``).

Every figure is a ratio of two measurements taken minutes (or seconds) apart
on the same machine, because the machines this runs on are shared and noisy;
absolute numbers are only context. No test asserts timings.

Measuring (one module per benchmark; each returns its results as a
JSON-able dict):

* ``scheduler_cost``: one scheduler step without a model, ours in three
  states against stock (its workload and checks: ``scheduler_workload``);
* ``throughput``: output throughput with limits configured far above demand
  (default 1e6 tok/s) against stock vLLM, alternating rounds, median ratio,
  judged on the engine without HTTP (``engine_throughput``, which times
  ``schedule()`` inside both engine cores with ``step_timing``);
* ``isolation``: one light user beside a heavy user with many streams, with
  and without limits; the light user's tokens/s and TTFT beside the heavy one
  divided by the same alone;
* ``idle``: CPU time of the engine-core process while only throttled
  requests are in flight, against the same plugin with its idle wait switched
  off (vLLM's own 1 ms loop, reproduced by a benchmark-only hook) and against
  stock vLLM decoding the same streams;
* ``accuracy``: measured rate / limit for several limits and stream counts,
  client side and engine side (the scheduler's dispatch log), plus the gap
  between a user's consecutive tokens as the scheduler dispatched them.

What they share: ``suite`` (runs the selection in order and gathers the raw
results), ``servers`` (the server configurations and the pool that runs
them), ``measure`` (server CPU, drained servers, client-side token counts,
median and quartiles), ``noise`` (how busy the rest of the machine is, and
the wait for a quiet one), ``hooks`` (benchmark-only ``sitecustomize`` hooks
in a server's or engine's processes), ``checkout`` (the repository they run
from: root, commit, machine, versions, PYTHONPATH for child processes) and
``progress`` (progress lines).

Presenting: ``report/`` turns the raw results into BENCHMARKS.md and its
figures, and nothing else; it never measures.
"""
