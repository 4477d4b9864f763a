"""A real LiteLLM proxy in front of a real vLLM server with the plugin: end
users behind the gateway's one key are each charged, limited and cached as
themselves, and two of them in a team share its limit; a client that goes
around the gateway cannot name them.

LiteLLM (from its PyPI package, no database) authenticates its callers with
its master key and sends every request to vLLM with one backend key, marked
``gateway: true`` in the keys file. With ``add_user_information_to_llm_headers``
(and header forwarding, without which it sends none) it names the end user it
resolved (from ``x-litellm-end-user-id``, else the body's ``user``) in
``x-litellm-user_api_key_end_user_id``, overwriting any such header its
client sent: that header is vLLM's ``--output-rate-user-header``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from harness.litellm_proxy import running_litellm
from vllm_output_rate.api_keys import digest
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.identity import Identity
from vllm_output_rate.integration.cache_salt import salt_for

pytestmark = pytest.mark.e2e

MODEL = "tiny"
GATEWAY_KEY, MALLORY_KEY = "key-of-the-gateway", "key-of-mallory"
MASTER_KEY = "sk-litellm-master"
ADMIN = {"Authorization": "Bearer admin-key"}
USER_HEADER = "x-litellm-user_api_key_end_user_id"
ALICE_RATE = 4  # tok/s; everyone else 1000
# A team of two end users behind the gateway: 6 tok/s for both together.
CREW_RATE, CREW = 6, ("carol", "dave")
# About 750 tokens (the tiny model takes 1,024): several KV blocks,
# so a prefix can be cached.
LONG_PROMPT = " ".join(f"fact {i}: the {i % 7}th river flows east." for i in range(40))
CACHED = 256  # tokens a repeated LONG_PROMPT finds cached, at least
QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def vllm(
    tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(
        f"litellm: {{keys: [{digest(GATEWAY_KEY)}], gateway: true}}\n"
        f"mallory: [{digest(MALLORY_KEY)}]\n"
    )
    args = [
        "--served-model-name", MODEL,
        "--default-user-output-tokens-per-second", "1000",
        "--user-output-tokens-per-second", f'{{"alice": {ALICE_RATE}}}',
        "--output-rate-api-keys", str(keys),
        "--output-rate-user-header", USER_HEADER,
        "--output-rate-cache-salt", "user",
        "--output-rate-teams",
        json.dumps({"crew": {"output_tokens_per_second": CREW_RATE,
                             "members": list(CREW)}}),
    ]  # fmt: skip
    env = {
        "VLLM_PLUGINS": "output_rate,output_rate_http",
        "VLLM_OUTPUT_RATE_ADMIN_KEY": ADMIN["Authorization"].split()[1],
    }
    with running_server(tiny_model_path, args, env=env) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(vllm: str) -> Iterator[str]:
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"hosted_vllm/{MODEL}",
                    "api_base": vllm + "/v1",
                    "api_key": GATEWAY_KEY,
                },
            }
        ],
        # Without forwarding, LiteLLM sends no user information at all.
        "general_settings": {
            "master_key": MASTER_KEY,
            "forward_client_headers_to_llm_api": True,
        },
        "litellm_settings": {"add_user_information_to_llm_headers": True},
    }
    with running_litellm(config) as url:
        yield url


def tokens(vllm: str) -> dict[str, int]:
    """Output tokens the engine charged so far, per user."""
    users = httpx.get(vllm + "/v1/output_rate/stats", headers=ADMIN).json()["users"]
    return {user: int(view["tokens_admitted"]) for user, view in users.items()}


def charged(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {
        user: count - before.get(user, 0)
        for user, count in after.items()
        if count != before.get(user, 0)
    }


def chat(
    url: str,
    key: str,
    n: int,
    headers: dict[str, str] | None = None,
    content: str = "hi",
    **body: object,
) -> httpx.Response:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": n,
        "ignore_eos": True,
        **body,
    }
    return httpx.post(
        url + "/v1/chat/completions",
        json=request,
        headers={
            **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {}),
        },
        timeout=120,
    )


def completion_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["completion_tokens"])


def test_end_users_behind_one_key_are_each_charged_as_themselves(
    vllm: str, gateway: str
) -> None:
    before = tokens(vllm)
    alice = chat(gateway, MASTER_KEY, 3, {"x-litellm-end-user-id": "alice"})
    bob = chat(gateway, MASTER_KEY, 5, user="bob")  # LiteLLM's other way
    nobody = chat(gateway, MASTER_KEY, 2)  # no end user: the gateway's own
    assert charged(before, tokens(vllm)) == {
        "alice": completion_tokens(alice),
        "bob": completion_tokens(bob),
        "litellm": completion_tokens(nobody),
    }
    assert completion_tokens(bob) == 5


def test_each_end_user_is_limited_as_itself(vllm: str, gateway: str) -> None:
    elapsed: dict[str, float] = {}
    limits: dict[str, str] = {}  # per minute, as LiteLLM passes them on

    def run(user: str, n: int) -> None:
        started = time.monotonic()
        answer = chat(gateway, MASTER_KEY, n, {"x-litellm-end-user-id": user})
        assert completion_tokens(answer) == n
        elapsed[user] = time.monotonic() - started
        limits[user] = answer.headers["x-ratelimit-limit-tokens"]

    before = throttled_steps(vllm)
    threads = [
        threading.Thread(target=run, args=("alice", 9)),
        threading.Thread(target=run, args=("bob", 30)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert limits == {"alice": str(60 * ALICE_RATE), "bob": str(60 * 1000)}
    # Alice, 9 tokens at 4 tok/s with a 0.1 s burst: at least 8 / 4 - 0.1 s.
    assert elapsed["alice"] >= (9 - 1) / ALICE_RATE - 0.1
    # Bob, behind the same gateway key, is never held back by her budget.
    after = throttled_steps(vllm)
    assert after.get("alice", 0) > before.get("alice", 0)
    assert after.get("bob", 0) == before.get("bob", 0)


def test_two_end_users_share_their_teams_limit(vllm: str, gateway: str) -> None:
    """carol and dave, each 1000 tok/s of their own, in a 6 tok/s team:
    both behind the gateway's one key, each charged as itself, the two
    together paced at the team's limit."""
    started: dict[str, float] = {}
    finished: dict[str, float] = {}
    limits: dict[str, str] = {}
    before = tokens(vllm)
    team_before = team_tokens(vllm)

    def run(user: str) -> None:
        started[user] = time.monotonic()
        answer = chat(gateway, MASTER_KEY, 9, {"x-litellm-end-user-id": user})
        assert completion_tokens(answer) == 9
        finished[user] = time.monotonic()
        limits[user] = answer.headers["x-ratelimit-limit-tokens"]

    threads = [threading.Thread(target=run, args=(user,)) for user in CREW]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert charged(before, tokens(vllm)) == dict.fromkeys(CREW, 9)
    assert team_tokens(vllm) - team_before == 18
    # A member's limit is the stricter of its own and its team's.
    assert limits == dict.fromkeys(CREW, str(60 * CREW_RATE))
    # 18 tokens at 6 tok/s with a 0.1 s burst: from the first request sent
    # to the last answer, at least 17 / 6 - 0.1 s; alone, each would take a
    # fraction of that. (Not each request's own time: the gateway may pass
    # one on later, after the other's first tokens.)
    window = max(finished.values()) - min(started.values())
    assert window >= (18 - 1) / CREW_RATE - 0.1, (started, finished)


def team_tokens(vllm: str) -> int:
    page = httpx.get(vllm + "/v1/output_rate/stats", headers=ADMIN).json()
    return int(page["teams"]["crew"]["tokens"])


def throttled_steps(vllm: str) -> dict[str, int]:
    users = httpx.get(vllm + "/v1/output_rate/stats", headers=ADMIN).json()["users"]
    return {user: int(v["throttled_request_steps"]) for user, v in users.items()}


def test_a_client_that_forges_the_header_is_refused_or_charged_as_itself(
    vllm: str, gateway: str
) -> None:
    forged = {USER_HEADER: "alice"}
    spoof = {"vllm_xargs": {"output_rate_user": "alice"}}
    before = tokens(vllm)
    # Around the gateway, without a key or with a wrong one: refused.
    for key in ("", "guess", GATEWAY_KEY + "x"):
        answer = chat(vllm, key, 2, forged, **spoof)
        assert answer.status_code == 401, answer.text
        assert "alice" not in answer.text
    # With an ordinary key: charged as itself, whatever it claims.
    mallory = chat(vllm, MALLORY_KEY, 4, forged, **spoof)
    # Through the gateway as bob, claiming alice by the header and the body
    # (LiteLLM forwards vllm_xargs): bob is charged.
    bob = chat(
        gateway, MASTER_KEY, 3, {"x-litellm-end-user-id": "bob", **forged}, **spoof
    )
    assert charged(before, tokens(vllm)) == {
        "mallory": completion_tokens(mallory),
        "bob": completion_tokens(bob),
    }


@pytest.mark.parametrize(
    "values",
    [
        [b"x" * 10_240],  # 10 kB
        [b"eve\x01"],  # a control character
        [b"eve\x1b[31m"],  # a terminal escape
        [b"\xff\xfe"],  # not UTF-8
        [b""],
        [b"alice", b"bob"],  # sent twice
    ],
    ids=["10kB", "control", "escape", "not-utf8", "empty", "twice"],
)
def test_a_malformed_header_from_the_gateway_key_gets_400(
    vllm: str, values: list[bytes]
) -> None:
    auth = (b"authorization", f"Bearer {GATEWAY_KEY}".encode())
    headers = [auth, *((USER_HEADER.encode(), value) for value in values)]
    before = tokens(vllm)
    for stream in (False, True):  # a real 400, never a 200 stream
        answer = httpx.post(
            vllm + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": stream,
            },
            headers=headers,
            timeout=60,
        )
        assert answer.status_code == 400, answer.text
    # Nothing was charged, and the server still serves the gateway.
    assert charged(before, tokens(vllm)) == {}
    erin = chat(vllm, GATEWAY_KEY, 2, {USER_HEADER: "erin"})
    assert charged(before, tokens(vllm)) == {"erin": completion_tokens(erin)}


def test_the_gateway_key_without_the_header_is_charged_to_the_gateway(
    vllm: str,
) -> None:
    before = tokens(vllm)
    # Body fields are not sources here (no --output-rate-user-fields), and
    # vllm_xargs never is with keys: the gateway's own budget.
    answer = chat(
        vllm, GATEWAY_KEY, 3, user="alice", vllm_xargs={"output_rate_user": "alice"}
    )
    assert charged(before, tokens(vllm)) == {"litellm": completion_tokens(answer)}


def prefix_cache(vllm: str) -> tuple[float, float]:
    """vLLM's prefix cache counters so far: tokens looked up, tokens found."""
    totals = {QUERIES: 0.0, HITS: 0.0}
    for line in httpx.get(vllm + "/metrics").text.splitlines():
        name = line.split("{", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals[QUERIES], totals[HITS]


def cached_tokens(vllm: str, send: Callable[[], httpx.Response]) -> float:
    """Prompt tokens a request found in the prefix cache."""
    queries, hits = prefix_cache(vllm)
    completion_tokens(send())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the counters follow the step's stats
        now_queries, now_hits = prefix_cache(vllm)
        if now_queries > queries:
            return now_hits - hits
        time.sleep(0.1)
    raise AssertionError("vLLM did not count the request's prefix cache lookup")


def test_each_end_users_prefix_cache_is_its_own(vllm: str, gateway: str) -> None:
    def via_gateway(user: str, **body: object) -> Callable[[], httpx.Response]:
        return lambda: chat(
            gateway,
            MASTER_KEY,
            1,
            {"x-litellm-end-user-id": user},
            content=LONG_PROMPT,
            **body,
        )

    cached_tokens(vllm, via_gateway("carol"))  # fills carol's cache
    assert cached_tokens(vllm, via_gateway("carol")) >= CACHED  # and she reuses it
    # Dave sends the same prompt through the same key: nothing of carol's.
    assert cached_tokens(vllm, via_gateway("dave")) == 0
    # A salt the client sends is replaced by its user's: carol's own salt
    # still finds her cache, and dave naming carol's salt finds nothing.
    carols_salt = salt_for(Identity("carol"))
    assert cached_tokens(vllm, via_gateway("carol", cache_salt="mine")) >= CACHED
    assert cached_tokens(vllm, via_gateway("erin", cache_salt=carols_salt)) == 0
