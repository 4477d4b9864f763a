"""The engine loop's wait while every runnable request is throttled.

vLLM's busy loop sleeps 1 ms after a step that ran no model work, so a fully
throttled engine would call schedule() a thousand times a second. Instead we
wait on the engine's input queue until the next token is due (at most 50 ms):
a new request or an abort lands in that queue and ends the wait at once.
The queue's condition variable is waited on without taking anything out.

No wait while vLLM still has batches in flight (``EngineCore.batch_queue``,
pipeline parallelism): their outputs are due, and the next step collects
them.
"""

from __future__ import annotations

import queue
import time
from typing import Any


def wait_for_budget(engine_core: Any) -> None:
    # Our schedulers hold their policy as `output_rate`; vLLM's have none.
    policy = getattr(getattr(engine_core, "scheduler", None), "output_rate", None)
    if policy is None:
        return  # stock scheduler: nothing to do
    timeout_s = policy.idle_wait_s()
    if timeout_s <= 0 or getattr(engine_core, "batch_queue", None):
        return
    input_queue = getattr(engine_core, "input_queue", None)
    if not isinstance(input_queue, queue.Queue):
        time.sleep(timeout_s)  # in-process engine: nothing can arrive meanwhile
        return
    with input_queue.not_empty:
        if not input_queue.queue:
            input_queue.not_empty.wait(timeout_s)
