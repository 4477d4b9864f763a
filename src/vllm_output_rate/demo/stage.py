"""The demo's stage: its servers, started together, and one run of a scene.

``Servers`` starts every server a batch of scenes needs (stock vLLM and with
limits, per scene) at once and stops them all on exit, Ctrl-C included:
starting is most of the demo's time, and servers that wait idle cost the
one under load almost nothing. Each server lives in a thread of its own for
its whole life, since ``running_server`` asks Linux to stop a server when
the thread that started it ends.

``play`` runs a scene's load against one server: each user in a client
process of its own (as real users are: parsing the hog's streams never
delays the light user's), from its ``start_after_s`` to the window's end.
With limits it polls the plugin's stats and, at the window's end, lifts
every limit through the admin API, so that paused requests finish in
seconds rather than minutes (paused, never cut); ``scene_limits`` puts them
back before a run is played again. It counts the CPU the rest
of the machine took meanwhile (``busy.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import secrets
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.demo.busy import OthersCpu
from vllm_output_rate.demo.engine_tally import EngineTally, TallyError, read_tally
from vllm_output_rate.demo.engine_view import EngineWatch
from vllm_output_rate.demo.figures import EngineView
from vllm_output_rate.demo.scenes import DemoUser, Scene
from vllm_output_rate.demo.server import RunningServer, running_server
from vllm_output_rate.loadtest import (
    LoadResult,
    LoadSpec,
    UserLoad,
    check_server,
    run_load_sync,
)

# Both runs: vLLM's own per-request timings, the engine's side of each answer.
COMMON_ARGS = ("--enable-per-request-metrics",)
START_TIMEOUT_S = 600.0  # servers starting together on a busy 2-core machine
LIFTED = 1_000_000.0  # tok/s: the limits after the window, to drain
LIMITS_PATH = "/v1/output_rate/limits"
READY = "ready"
ADMIN_KEY_ENV = "VLLM_OUTPUT_RATE_ADMIN_KEY"  # integration/http_plugin.py


class DemoError(RuntimeError):
    """Nothing to judge: the admin API or the plugin's stats failed."""


@dataclass
class ServerSpec:
    scene: Scene
    limited: bool
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    admin_key: str = ""

    @classmethod
    def for_scene(cls, scene: Scene, limited: bool) -> ServerSpec:
        args = [*scene.server_args, *COMMON_ARGS]
        if not limited:
            # Stock vLLM: none of the plugin's parts loaded, not even idle.
            return cls(scene, False, args, {"VLLM_PLUGINS": ""})
        key = secrets.token_urlsafe(16)
        env = {"VLLM_PLUGINS": "output_rate,output_rate_http", ADMIN_KEY_ENV: key}
        return cls(scene, True, args + scene.limit_flags(), env, key)


class ServerThread(threading.Thread):
    def __init__(self, model: str, spec: ServerSpec, log_dir: Path) -> None:
        super().__init__(daemon=True, name=f"server-{spec.scene.key}")
        self.model, self.spec, self.log_dir = model, spec, log_dir
        self.url: RunningServer | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with running_server(
                self.model,
                self.spec.args,
                env=self.spec.env,
                start_timeout_s=START_TIMEOUT_S,
                log_dir=self.log_dir,
            ) as url:
                self.url = url
                self.ready.set()
                self.done.wait()
        except BaseException as exc:  # handed to the main thread
            self.error = exc
        finally:
            self.ready.set()


class Servers:
    """``with Servers(model, specs, out) as servers``: all started, or an
    error (the others stopped); all stopped on exit."""

    def __init__(self, model: str, specs: list[ServerSpec], out: Path) -> None:
        self.threads = [
            ServerThread(
                model, s, out / s.scene.key / ("limits" if s.limited else "stock")
            )
            for s in specs
        ]

    def __enter__(self) -> Servers:
        for t in self.threads:
            t.start()
        try:
            for t in self.threads:
                while not t.ready.wait(0.5):
                    pass  # a short wait, so that Ctrl-C gets through
            failed = [t.error for t in self.threads if t.error is not None]
            if failed:
                raise failed[0]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.threads:
            t.done.set()
        for t in self.threads:
            t.join()

    def stopped(self) -> list[str]:
        """The servers that stopped while in use (from outside the demo: it
        stops them only on exit), one line each, for the error message."""
        lines = []
        for t in self.threads:
            if t.url is not None and t.url.process.poll() is not None:
                side = "with limits" if t.spec.limited else "stock vLLM"
                lines.append(
                    f"the {side} server of {t.spec.scene.title} stopped (exit "
                    f"{t.url.process.returncode}; log: {t.url.log_path})"
                )
        return lines

    def url(self, scene: Scene, limited: bool) -> tuple[str, ServerSpec]:
        for t in self.threads:
            if t.spec.scene is scene and t.spec.limited == limited and t.url:
                return t.url, t.spec
        raise KeyError((scene.key, limited))


@dataclass
class Played:
    results: dict[str, LoadResult]
    engine: EngineView | None
    others: OthersCpu
    tally: EngineTally  # what the server's engine did in the run


def _user_load(conn: Connection, spec: LoadSpec, start_after_s: float) -> None:
    """A user's client, in a process of its own: checks the server, says it
    is ready, waits for the run's start (the monotonic clock is the
    machine's), runs its load and sends back the result, or the exception.
    The check comes first so that every window opens on time, however slow
    the server is to answer once loaded."""
    try:
        asyncio.run(check_server(spec))
        conn.send(READY)
        start = conn.recv()
        time.sleep(max(0.0, start + start_after_s - time.monotonic()))
        conn.send(run_load_sync(spec, server_checked=True))
    except BaseException as exc:  # handed to the demo's process
        conn.send(exc)


def _load_spec(
    scene: Scene, user: DemoUser, url: str, model: str, limited: bool
) -> LoadSpec:
    return LoadSpec(
        base_url=url,
        model=model,
        users=[
            UserLoad(
                user.name,
                user.streams,
                scene.limit(user) if limited else None,
                think_s=user.think_s,
            )
        ],
        max_tokens=user.max_tokens,
        duration_s=scene.duration_s - user.start_after_s,
        prompt=user.prompt,
    )


def _receive(conn: Connection) -> Any:
    message = conn.recv()
    if isinstance(message, BaseException):
        raise message
    return message


def lifted_limits(scene: Scene) -> dict[str, Any]:
    """The admin API body that lifts every limit: what runs after a window."""
    return {
        "default_user_output_tokens_per_second": LIFTED,
        "user_output_tokens_per_second": {u.name: LIFTED for u in scene.users},
    }


def scene_limits(scene: Scene) -> dict[str, Any]:
    """The admin API body that puts the scene's own limits back (its flags'):
    before a run is played again on the same server."""
    return {
        "default_user_output_tokens_per_second": scene.default_limit,
        "user_output_tokens_per_second": {
            u.name: u.limit for u in scene.users if u.limit is not None
        },
        "remove_users": [u.name for u in scene.users if u.limit is None],
    }


def put_limits(url: str, admin_key: str, body: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {admin_key}"}
    try:
        httpx.put(
            url + LIMITS_PATH, json=body, headers=headers, timeout=60
        ).raise_for_status()
    except httpx.HTTPError as exc:
        raise DemoError(f"could not change the limits between runs: {exc}") from exc


def _tally(url: str) -> EngineTally:
    try:
        return read_tally(url)
    except TallyError as exc:
        raise DemoError(str(exc)) from exc


def _drive(
    scene: Scene, url: str, model: str, spec: ServerSpec, watch: EngineWatch | None
) -> tuple[dict[str, LoadResult], float, EngineTally]:
    """Every user's load, each in a client process of its own: one client
    per user, as in real life, so that parsing the hog's stream never
    delays the light user's. Returns the results, the run's start and what
    the server's engine did meanwhile."""
    context = multiprocessing.get_context("spawn")
    clients = []
    try:
        for user in scene.users:
            ours, theirs = context.Pipe()
            load = _load_spec(scene, user, url, model, spec.limited)
            process = context.Process(
                target=_user_load, args=(theirs, load, user.start_after_s), daemon=True
            )
            process.start()
            clients.append((process, ours))
        for _, conn in clients:
            if _receive(conn) != READY:
                raise RuntimeError("a client process did not start")
        before = _tally(url)
        start = time.monotonic()  # the engine's clock too
        for _, conn in clients:
            conn.send(start)
        with watch or contextlib.nullcontext():
            if watch is not None:
                time.sleep(max(0.0, start + scene.duration_s - time.monotonic()))
                put_limits(url, spec.admin_key, lifted_limits(scene))
            results = [_receive(conn) for _, conn in clients]
        by_user = dict(zip([u.name for u in scene.users], results, strict=True))
        return by_user, start, _tally(url) - before
    finally:
        for process, _ in clients:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join()


def play(scene: Scene, url: str, model: str, spec: ServerSpec) -> Played:
    """Run ``scene``'s load once against the server at ``url``."""
    watch = EngineWatch(url, spec.admin_key) if spec.limited else None
    with OthersCpu() as others:
        results, start, tally = _drive(scene, url, model, spec, watch)
    engine = (
        None if watch is None else EngineView(watch, start, start + scene.duration_s)
    )
    return Played(results, engine, others, tally)
