"""The demo's scenes, as declarations: what is scarce, who loads, what is judged.

A ``Scene`` is data, nothing more: the server flags both of its runs share
(stock vLLM, then with limits), the users with their loads and limits, and
each user's role, which says what is judged (``judging.py``):

* ``light``: a user far below its limit; with limits it must come out
  better than on stock vLLM: its time to first token (p50) lower and its
  rate higher, at the engine and at the client;
* ``throttled``: a user over its limit; at the engine it must stay within
  the bound and get close to its limit;
* ``other``: load that is only shown.

A 429 answered to a user declared ``refusable`` is its own excess refused by
design (per-user admission caps); a 503 on stock vLLM is its queue caps
full, what a scene about the queue shows; any other failed request (a 503
with limits included) fails the demo. A scene judges its light user by
``light_measure``: ``latency`` (time to first token and rate),
``first-token`` where prefill is scarce (its later tokens wait for full
steps either way) or, where the queue is scarce, ``answers`` (the share of
its requests answered). Adding a
scene is adding one ``Scene(...)`` to ``SCENES``; with limits, every user
not given a limit of its own gets ``default_limit``, and ``limited_args``
adds the plugin's other flags (caps).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Literal

from vllm_output_rate.loadtest import DEFAULT_PROMPT

Role = Literal["light", "throttled", "other"]
ROLES: tuple[Role, ...] = ("light", "throttled", "other")
LightMeasure = Literal["latency", "first-token", "answers"]
LIGHT_MEASURES: tuple[LightMeasure, ...] = ("latency", "first-token", "answers")


@dataclass(frozen=True)
class DemoUser:
    """One user of a scene: ``streams`` request loops of ``max_tokens`` each,
    from ``start_after_s`` into the run until its end."""

    name: str
    role: Role
    streams: int
    max_tokens: int
    limit: float | None = None  # tok/s with limits; None: the scene's default
    prompt: str = DEFAULT_PROMPT
    start_after_s: float = 0.0
    refusable: bool = False  # a 429 to this user is its own excess, by design
    think_s: float = 0.0  # each stream's pause after an answer


@dataclass(frozen=True)
class Scene:
    key: str  # a short name for files and the command line
    title: str  # what is scarce, as the table and the chart say it
    server_args: tuple[str, ...]  # both runs, stock and with limits
    users: tuple[DemoUser, ...]
    default_limit: float = 1000.0  # tok/s for users without a limit of their own
    duration_s: float = 15.0
    limited_args: tuple[str, ...] = ()  # the plugin's other flags, with limits only
    light_measure: LightMeasure = "latency"  # what the light user is judged by

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]*", self.key):
            raise ValueError(f"scene key {self.key!r}: lower-case letters, digits, -")
        names = [u.name for u in self.users]
        if len(set(names)) != len(names):
            raise ValueError(f"scene {self.key}: a user is listed twice: {names}")
        if not any(u.role == "light" for u in self.users):
            raise ValueError(f"scene {self.key}: no light user to judge")
        if self.light_measure not in LIGHT_MEASURES:
            raise ValueError(
                f"scene {self.key}: light_measure must be one of {LIGHT_MEASURES}"
            )
        if not self.default_limit > 0 or not self.duration_s > 0:
            raise ValueError(f"scene {self.key}: limits and duration must be > 0")
        for u in self.users:
            self._check_user(u)

    def _check_user(self, u: DemoUser) -> None:
        where = f"scene {self.key}, user {u.name!r}"
        if u.role not in ROLES:
            raise ValueError(f"{where}: role must be one of {ROLES}, got {u.role!r}")
        if u.streams < 1 or u.max_tokens < 1:
            raise ValueError(f"{where}: streams and max_tokens must be >= 1")
        if u.limit is not None and not u.limit > 0:
            raise ValueError(f"{where}: a limit must be > 0 tok/s, got {u.limit}")
        if u.role == "throttled" and u.limit is None:
            raise ValueError(f"{where}: a throttled user needs a limit of its own")
        if not u.think_s >= 0:
            raise ValueError(f"{where}: think_s must be >= 0, got {u.think_s}")
        if not 0 <= u.start_after_s < self.duration_s:
            raise ValueError(f"{where}: it must start within the run")

    def limit(self, user: DemoUser) -> float:
        """The user's limit in the run with limits."""
        return self.default_limit if user.limit is None else user.limit

    def limit_flags(self) -> list[str]:
        """The flags that switch limiting on, added to ``server_args``."""
        own = {u.name: u.limit for u in self.users if u.limit is not None}
        flags = ["--default-user-output-tokens-per-second", f"{self.default_limit:g}"]
        if own:
            flags += ["--user-output-tokens-per-second", json.dumps(own)]
        return flags + list(self.limited_args)

    def with_role(self, role: Role) -> list[DemoUser]:
        return [u for u in self.users if u.role == role]


# One light user: a single stream of short answers, arriving once the
# scarce resource is taken (2 s in), far below its limit (the default).
LIGHT = DemoUser("light", "light", streams=1, max_tokens=30, start_after_s=2.0)

# About 600 and 300 tokens on the tiny model.
LONG_PROMPT = " ".join(f"w{i}" for i in range(180))
CONTEXT_PROMPT = " ".join(f"w{i}" for i in range(90))

SCENES: tuple[Scene, ...] = (
    Scene(
        key="kv-blocks",
        title="KV blocks scarce",
        # A KV cache of 40 blocks of 32 tokens, and the prefix cache off so
        # that each of the hog's ~300-token contexts with its answer takes
        # its own ~11 blocks: 3 of its requests fit. Resident slots are
        # plenty (vLLM's default): KV blocks run out. On stock vLLM the
        # light user waits behind the hog's queued requests, and the hog's
        # first 24 alone take about as long as the run to drain, so it waits
        # however slowly the hog's client and vLLM's HTTP front end send
        # the next ones (with 40-token answers a slow machine let the light
        # user in between the hog's turns).
        server_args=(
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "40",
            "--no-enable-prefix-caching",
        ),
        users=(
            LIGHT,
            DemoUser(
                "hog",
                "throttled",
                streams=24,
                max_tokens=70,
                limit=5,
                prompt=CONTEXT_PROMPT,
            ),
        ),
        duration_s=12.0,
    ),
    Scene(
        key="prefill-tokens",
        title="Prefill tokens scarce",
        # 512 tokens a step, and the prefix cache off, so that each of the
        # hog's prompts is computed whole (as distinct prompts would be):
        # its 16 streams of ~600-token prompts, one token out each, fill
        # every step. No limit binds: on stock vLLM the light user's request
        # waits until the prompts ahead are computed; with limits it gets
        # its share of the next step.
        server_args=("--max-num-batched-tokens", "512", "--no-enable-prefix-caching"),
        users=(
            # Short answers: each of its tokens waits for a full step in
            # both runs; what the scene shows is its first one.
            dataclasses.replace(LIGHT, max_tokens=8),
            DemoUser("hog", "other", streams=16, max_tokens=1, prompt=LONG_PROMPT),
        ),
        light_measure="first-token",
    ),
    Scene(
        key="queue-places",
        title="Queue places scarce",
        # vLLM answers 503 once 16 requests are in flight. On stock vLLM the
        # hog's 32 streams keep its 16 places taken (a stream whose request
        # ends sends the next at once, 16 more retry): the light user gets
        # in only when it wins a freed place. With limits, the hog's paused
        # requests count against its own cap (vLLM's, 16 here: its excess
        # gets 429), not vLLM's: the light user is always admitted.
        server_args=("--max-num-queued-reqs", "16"),
        users=(
            # It reads each answer for half a second: back to back, a request
            # that got a place on stock vLLM would free it and take it again
            # before anyone else could, every time.
            dataclasses.replace(LIGHT, think_s=0.5),
            DemoUser(
                "hog", "throttled", streams=32, max_tokens=40, limit=5, refusable=True
            ),
        ),
        light_measure="answers",
    ),
)


def scene_by_key(key: str) -> Scene:
    for scene in SCENES:
        if scene.key == key:
            return scene
    raise KeyError(f"no scene {key!r}; the scenes: {[s.key for s in SCENES]}")
