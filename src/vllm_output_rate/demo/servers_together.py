"""Several vLLM servers started at once, each owned by a thread of its own.

Starting a server is most of the time a demo, a benchmark or an end-to-end
test waits for, and servers started together take little longer than one.
``running_server`` arms PR_SET_PDEATHSIG, which fires when the *thread* that
forked the server exits, so each server is started and held by a
``ServerThread`` that stays alive until it is stopped.

``running_servers(model, launches)`` yields the servers' URLs once all
answer, or raises the first start's error with the others stopped; all
are stopped on exit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from vllm_output_rate.demo.server import START_TIMEOUT_S, RunningServer, running_server


class ServerThread(threading.Thread):
    """One server for the thread's whole life: ``ready`` is set once it
    answers (``url``) or failed to start (``error``); ``stop`` ends it
    (``stop_soon`` without waiting)."""

    def __init__(
        self,
        model: str,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        log_dir: Path | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        name = f"server-{log_dir.name}" if log_dir is not None else "server"
        super().__init__(name=name, daemon=True)
        self.model, self.args, self.env = model, list(args), dict(env or {})
        self.log_dir, self.start_timeout_s = log_dir, start_timeout_s
        self.url: RunningServer | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self._done = threading.Event()

    def run(self) -> None:
        try:
            with running_server(
                self.model,
                self.args,
                env=self.env,
                start_timeout_s=self.start_timeout_s,
                log_dir=self.log_dir,
            ) as url:
                self.url = url
                self.ready.set()
                self._done.wait()
        except BaseException as exc:  # handed to whoever waits on ready
            self.error = exc
        finally:
            self.ready.set()

    def wait_ready(self) -> None:
        """Until it answers or failed; short waits, so Ctrl-C gets through."""
        while not self.ready.wait(0.5):
            pass

    def stop_soon(self) -> None:
        """Stop its server, without waiting (to stop several together)."""
        self._done.set()

    def stop(self) -> None:
        self.stop_soon()
        if self.is_alive():
            self.join()


@contextlib.contextmanager
def running_servers(
    model: str,
    launches: Sequence[tuple[Sequence[str], Mapping[str, str]]],
    *,
    log_dirs: Sequence[Path | None] | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[list[RunningServer]]:
    """``running_server`` for each ``(args, env)`` of ``launches``, all
    started together; their URLs in the same order."""
    dirs = list(log_dirs) if log_dirs is not None else [None] * len(launches)
    threads = [
        ServerThread(model, args, env, log_dir=d, start_timeout_s=start_timeout_s)
        for (args, env), d in zip(launches, dirs, strict=True)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.wait_ready()
        for thread in threads:
            if thread.error is not None:
                raise thread.error
        yield [t.url for t in threads if t.url is not None]
    finally:
        for thread in threads:
            thread.stop_soon()
        for thread in threads:
            thread.stop()
