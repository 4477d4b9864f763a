"""Operating the plugin on a live server: metrics, live limit changes."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from vllm_output_rate.demo.server import running_server
from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync

pytestmark = pytest.mark.e2e

KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_path: str):
    args = [
        "--default-user-output-tokens-per-second",
        "40",
        "--user-output-tokens-per-second",
        '{"user-a": 60, "user-b": 30}',
        "--output-rate-metrics-users",
        '["user-b"]',
        "--output-rate-metrics-recent-users",
        "3",
        # Prompt rates far above what the tests send: on, never binding.
        "--default-user-prompt-tokens-per-second",
        "1000000",
        "--user-prompt-tokens-per-second",
        '{"user-b": 500000}',
    ]
    env = {
        "VLLM_PLUGINS": "output_rate,output_rate_http",
        "VLLM_OUTPUT_RATE_ADMIN_KEY": KEY,
    }
    with running_server(tiny_model_path, args, env=env) as url:
        yield url


def metrics(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:output_rate_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def complete(url: str, model: str, user: str | None, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": "hi",
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if user:
        body["vllm_xargs"] = {"output_rate_user": user}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_per_user_metrics_on_vllms_metrics_endpoint(server, tiny_model_path) -> None:
    before = metrics(server)
    complete(server, tiny_model_path, "user-b", 12)
    complete(server, tiny_model_path, None, 5)
    visitors = [f"visitor-{i}" for i in range(6)]
    for visitor in visitors:
        complete(server, tiny_model_path, visitor, 2)
    time.sleep(2.5)  # the API server polls the engine once a second
    after = metrics(server)

    def delta(user: str) -> float:
        name = f'vllm:output_rate_tokens_admitted_total{{user="{user}"}}'
        return after.get(name, 0) - before.get(name, 0)

    assert delta("user-b") == 12  # listed: always its own label
    assert delta("__anonymous__") == 5
    # At most 3 users with recent traffic get their own label; the rest
    # share __other__, and no token is lost between the two.
    labelled = [v for v in visitors if delta(v) > 0]
    assert len(labelled) <= 3
    assert delta("__other__") >= 2 * (len(visitors) - 3)
    assert delta("__other__") + sum(map(delta, visitors)) == 2 * len(visitors)
    assert after['vllm:output_rate_limit_tokens_per_second{user="user-b"}'] == 30
    assert after['vllm:output_rate_limit_tokens_per_second{user="__default__"}'] == 40
    # Prompt rates on: each label's prompt limit, and its prompt tokens
    # computed (all but the last of each prompt, which counts as output).
    prompt_limit = "vllm:output_rate_prompt_limit_tokens_per_second"
    assert after[f'{prompt_limit}{{user="user-b"}}'] == 500_000
    assert after[f'{prompt_limit}{{user="__default__"}}'] == 1_000_000
    prompt = 'vllm:output_rate_prompt_tokens_total{user="user-b"}'
    assert after[prompt] - before.get(prompt, 0) >= 1
    assert after['vllm:output_rate_token_gap_seconds_count{user="user-b"}'] >= 11
    first = 'vllm:output_rate_time_to_first_token_seconds_count{user="user-b"}'
    assert after[first] - before.get(first, 0) == 1
    # Every visitor has its own record at the admin endpoint.
    users = httpx.get(server + "/v1/output_rate/stats", headers=ADMIN).json()["users"]
    assert all(users[v]["tokens_admitted"] == 2 for v in visitors)


def test_the_admin_endpoint_needs_the_key_and_refuses_bad_input(server) -> None:
    limits_url = server + "/v1/output_rate/limits"
    assert httpx.get(limits_url).status_code == 401
    assert (
        httpx.get(limits_url, headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    before = httpx.get(limits_url, headers=ADMIN).json()
    assert before["user_output_tokens_per_second"]["user-a"] == 60
    for bad in (
        {"user_output_tokens_per_second": {"user-a": 10, "user-c": -1}},
        {"default_user_output_tokens_per_second": "fast"},
        {"remove_users": "user-a"},
        {"unknown": 1},
        # Only the engine knows user-a's limit (60): refused there, whole.
        {
            "user_output_tokens_per_second": {"user-c": 10},
            "user_min_output_tokens_per_second": {"user-a": 100},
        },
    ):
        response = httpx.put(limits_url, json=bad, headers=ADMIN)
        assert response.status_code == 400, (bad, response.text)
    response = httpx.put(limits_url, content=b"{not json", headers=ADMIN)
    assert response.status_code == 400
    # Nothing was partly applied.
    assert httpx.get(limits_url, headers=ADMIN).json() == before
    stats_url = server + "/v1/output_rate/stats"
    assert httpx.get(stats_url).status_code == 401
    for query in ("limit=0", "limit=10001", "limit=x", "after=", "page=2"):
        response = httpx.get(f"{stats_url}?{query}", headers=ADMIN)
        assert response.status_code == 400, (query, response.text)


def test_the_stats_endpoint_pages_through_every_user(server, tiny_model_path) -> None:
    for user in ("page-a", "page-b", "page-c"):
        complete(server, tiny_model_path, user, 1)
    seen: list[str] = []
    after = None
    while True:
        query = {"limit": "2"} if after is None else {"limit": "2", "after": after}
        page = httpx.get(
            server + "/v1/output_rate/stats", params=query, headers=ADMIN
        ).json()
        assert len(page["users"]) <= 2
        seen += list(page["users"])
        after = page["next"]
        if after is None:
            break
    assert seen == sorted(seen) and len(seen) == page["total"]
    assert {"page-a", "page-b", "page-c"} <= set(seen)


def test_the_limits_endpoint_pages_and_a_page_goes_back_unchanged(server) -> None:
    limits_url = server + "/v1/output_rate/limits"
    added = {f"lim-{i}": 100 + i for i in range(5)}
    body = {"user_output_tokens_per_second": added}
    # A bad page is refused before anything is applied.
    for query in ("limit=0", "limit=x", "after=", "page=2"):
        refused = httpx.put(f"{limits_url}?{query}", json=body, headers=ADMIN)
        assert refused.status_code == 400, (query, refused.text)
        refused = httpx.get(f"{limits_url}?{query}", headers=ADMIN)
        assert refused.status_code == 400, (query, refused.text)
    assert (
        "lim-0"
        not in httpx.get(limits_url, headers=ADMIN).json()[
            "user_output_tokens_per_second"
        ]
    )
    changed = httpx.put(f"{limits_url}?limit=2", json=body, headers=ADMIN)
    assert changed.status_code == 200, changed.text
    try:
        whole = httpx.get(limits_url, headers=ADMIN).json()
        total = 2 + len(added)  # user-a and user-b from the command line
        assert changed.headers["x-total-count"] == str(total)
        assert len(changed.json()["user_output_tokens_per_second"]) == 2
        pages, url = [], f"{limits_url}?limit=2"
        while url:
            response = httpx.get(url, headers=ADMIN)
            assert response.status_code == 200, response.text
            assert response.headers["x-total-count"] == str(total)
            pages.append(response.json())
            next_page = response.links.get("next")
            url = server + next_page["url"] if next_page else ""
        assert len(pages) == 4  # 7 users, 2 a page
        rates = [p["user_output_tokens_per_second"] for p in pages]
        assert [u for r in rates for u in r] == sorted(
            whole["user_output_tokens_per_second"]
        )
        assert {u: v for r in rates for u, v in r.items()} == whole[
            "user_output_tokens_per_second"
        ]
        # A page read is a valid body: putting it back changes nothing.
        again = httpx.put(limits_url, json=pages[1], headers=ADMIN)
        assert again.status_code == 200, again.text
        assert httpx.get(limits_url, headers=ADMIN).json() == whole
    finally:
        httpx.put(limits_url, json={"remove_users": list(added)}, headers=ADMIN)
    left = httpx.get(limits_url, headers=ADMIN)
    assert left.headers["x-total-count"] == "2" and "link" not in left.headers


def test_lowering_a_rate_mid_stream_takes_effect(server, tiny_model_path) -> None:
    limits_url = server + "/v1/output_rate/limits"

    def admitted() -> float:
        stats = httpx.get(server + "/v1/output_rate/stats", headers=ADMIN).json()
        return stats["users"].get("user-a", {}).get("tokens_admitted", 0)

    spec = LoadSpec(
        base_url=server,
        model=tiny_model_path,
        users=[UserLoad("user-a", 2, None)],
        max_tokens=20,
        duration_s=9,
    )
    results = []
    load = threading.Thread(target=lambda: results.append(run_load_sync(spec)))
    load.start()
    try:
        # Engine-side counts (fresh from the engine, no HTTP buffering).
        time.sleep(1.5)
        start, t0 = admitted(), time.monotonic()
        time.sleep(2)
        before_rate = (admitted() - start) / (time.monotonic() - t0)
        changed = httpx.put(
            limits_url,
            json={"user_output_tokens_per_second": {"user-a": 10}},
            headers=ADMIN,
        )
        assert changed.status_code == 200
        time.sleep(0.5)
        start, t0 = admitted(), time.monotonic()
        time.sleep(3)
        after_tokens, span = admitted() - start, time.monotonic() - t0
    finally:
        load.join()
        httpx.put(
            limits_url,
            json={"user_output_tokens_per_second": {"user-a": 60}},
            headers=ADMIN,
        )
    assert results and results[0].ok
    # Before: the old 60 tok/s limit (or the CPU) bounds user-a, well above 10.
    assert before_rate > 20, before_rate
    # After: the new limit's bound over the window, +2 tokens for the time the
    # stats requests themselves take.
    assert after_tokens <= (span + 0.1) * 10 + 1 + 2, (after_tokens, span)
    assert after_tokens >= 0.8 * 10 * span - 2, (after_tokens, span)


def test_prompt_rates_are_read_and_changed_live(server) -> None:
    limits_url = server + "/v1/output_rate/limits"
    before = httpx.get(limits_url, headers=ADMIN).json()
    assert before["default_user_prompt_tokens_per_second"] == 1_000_000
    assert before["user_prompt_tokens_per_second"] == {"user-b": 500_000}
    for bad in (
        {"user_prompt_tokens_per_second": {"prompt-only": 0}},
        {"default_user_prompt_tokens_per_second": "fast"},
    ):
        response = httpx.put(limits_url, json=bad, headers=ADMIN)
        assert response.status_code == 400, (bad, response.text)
    body = {"user_prompt_tokens_per_second": {"prompt-only": 250_000}}
    changed = httpx.put(limits_url, json=body, headers=ADMIN)
    assert changed.status_code == 200, changed.text
    try:
        now = httpx.get(limits_url, headers=ADMIN).json()
        assert now["user_prompt_tokens_per_second"] == {
            "user-b": 500_000,
            "prompt-only": 250_000,
        }
        assert (
            now["user_output_tokens_per_second"]
            == before["user_output_tokens_per_second"]
        )
    finally:
        httpx.put(limits_url, json={"remove_users": ["prompt-only"]}, headers=ADMIN)
    assert httpx.get(limits_url, headers=ADMIN).json() == before


def test_teams_are_read_and_changed_live(server) -> None:
    limits_url = server + "/v1/output_rate/limits"
    before = httpx.get(limits_url, headers=ADMIN).json()
    assert "teams" not in before  # none configured
    for bad in (
        {"teams": {"t": {"output_tokens_per_second": 0, "members": ["x"]}}},
        {"teams": {"t": {"members": ["x"]}}},
        {"teams": {"t": {"output_tokens_per_second": 5, "members": ["x\u0007"]}}},
        {"remove_teams": ["nobody"]},  # refused by the engine: no such team
    ):
        response = httpx.put(limits_url, json=bad, headers=ADMIN)
        assert response.status_code == 400, (bad, response.text)
    crew = {"crew": {"output_tokens_per_second": 80.0, "members": ["m1", "m2"]}}
    changed = httpx.put(limits_url, json={"teams": crew}, headers=ADMIN)
    assert changed.status_code == 200, changed.text
    try:
        assert httpx.get(limits_url, headers=ADMIN).json()["teams"] == crew
        # A user already in a team cannot join another: refused whole.
        other = {"other": {"output_tokens_per_second": 5, "members": ["m1"]}}
        response = httpx.put(limits_url, json={"teams": other}, headers=ADMIN)
        assert response.status_code == 400, response.text
        assert "already a member of team 'crew'" in response.text
    finally:
        httpx.put(limits_url, json={"remove_teams": ["crew"]}, headers=ADMIN)
    assert httpx.get(limits_url, headers=ADMIN).json()["teams"] == {}
