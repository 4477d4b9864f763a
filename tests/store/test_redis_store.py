"""The lease script and the limits table, against a real redis-server."""

from __future__ import annotations

import socket
import threading

import pytest

from harness.redis_server import RedisServer
from vllm_output_rate.store.messages import (
    UNBOUNDED,
    LeaseAsk,
    StoreIncompatible,
    StoreUnavailable,
)
from vllm_output_rate.store.redis_store import RedisLeaseStore
from vllm_output_rate.store.settings import StoreSettings

S = 1_000_000  # microseconds
GRACE = 300_000  # 0.3 s


@pytest.fixture
def store(redis_server: RedisServer, store_prefix: str):
    client = RedisLeaseStore(
        StoreSettings(url=redis_server.url, key_prefix=store_prefix, lease_s=2.0)
    )
    client.check()
    client.seed_limits(100.0, {"gold": 1000.0})
    yield client
    client.close()


def ask(store, engine, now_s, *asks):
    return store.exchange(engine, list(asks), grace_us=GRACE, now_us=round(now_s * S))


def test_one_engine_gets_the_whole_limit(store) -> None:
    ex = ask(store, "a", 10, LeaseAsk("u", 3), LeaseAsk("gold", 1))
    assert ex.rates == {"u": 100.0, "gold": 1000.0}
    assert ex.engines == 1 and ex.limits_version == 1 and ex.fresh
    assert not ex.shared
    assert not ask(store, "a", 10.1).fresh  # registered now


def test_shares_follow_demand_and_wait_for_the_holder_to_lower(store) -> None:
    assert ask(store, "a", 10, LeaseAsk("u", 3)).rates["u"] == 100.0
    # b's fair share is 25, but a still holds all 100: nothing free yet,
    # and a is asked to renew.
    b = ask(store, "b", 10.1, LeaseAsk("u", 1))
    assert b.rates["u"] == 0.0 and "u" in b.shared
    a = ask(store, "a", 10.2)  # renews u on its own: the store asked it to
    assert a.rates == {"u": 75.0} and "u" in a.shared
    # a's old 100 stays counted for the grace plus one token's spacing.
    assert ask(store, "b", 10.2 + 0.29, LeaseAsk("u", 1)).rates["u"] == 0.0
    assert ask(store, "b", 10.2 + 0.32, LeaseAsk("u", 1)).rates["u"] == 25.0


def test_an_engine_that_uses_less_leaves_the_rest_to_others(store) -> None:
    ask(store, "a", 10, LeaseAsk("u", 3, want=30.0))
    b = ask(store, "b", 10, LeaseAsk("u", 1))
    assert b.rates["u"] == 70.0
    # Both unbounded again: 3:1.
    assert ask(store, "a", 11, LeaseAsk("u", 3, want=UNBOUNDED)).rates["u"] == 30.0
    assert ask(store, "b", 11, LeaseAsk("u", 1)).rates["u"] == 25.0
    assert ask(store, "a", 12, LeaseAsk("u", 3)).rates["u"] == 75.0


def test_shares_never_sum_above_the_limit(store) -> None:
    """Three engines in every order of asks: counted rates <= limit."""
    engines = {"a": 1, "b": 2, "c": 4}
    granted: dict[str, float] = {}
    now = 10.0
    for step in range(40):
        engine = "abc"[step * 7 % 3]
        weight = engines[engine] if step % 11 else 0
        granted[engine] = ask(store, engine, now, LeaseAsk("u", weight)).rates["u"]
        assert sum(granted.values()) <= 100.0 + 1e-9
        now += 0.05


def test_a_returned_lease_frees_its_share_after_the_grace(store) -> None:
    ask(store, "a", 10, LeaseAsk("u", 1))
    assert ask(store, "a", 11, LeaseAsk("u", 0)).rates["u"] == 0.0
    assert ask(store, "b", 11.1, LeaseAsk("u", 1)).rates["u"] == 0.0
    assert ask(store, "b", 11 + 0.32, LeaseAsk("u", 1)).rates["u"] == 100.0


def test_a_dead_engine_strands_its_lease_until_it_expires(store) -> None:
    ask(store, "a", 10, LeaseAsk("u", 1))
    ask(store, "b", 10, LeaseAsk("u", 1))
    ask(store, "a", 10.1, LeaseAsk("u", 1))  # a lowers to 50
    assert ask(store, "b", 10.5, LeaseAsk("u", 1)).rates["u"] == 50.0
    # a dies after 10.1: its lease lasts lease_s + grace + spacing.
    assert ask(store, "b", 10.1 + 2.0 + 0.2, LeaseAsk("u", 1)).rates["u"] == 50.0
    late = ask(store, "b", 10.1 + 2.0 + 0.35, LeaseAsk("u", 1))
    assert late.rates["u"] == 100.0 and late.engines == 1


def test_limits_are_seeded_once_updated_and_versioned(store) -> None:
    assert not store.seed_limits(5.0, {})  # already there
    limits = store.read_limits()
    assert limits is not None
    assert (limits.version, limits.default_rate, limits.user_rates) == (
        1,
        100.0,
        {"gold": 1000.0},
    )
    version = store.update_limits(
        default_rate=50.0, user_rates={"x": 2.5}, remove_users=["gold"]
    )
    assert version == 2
    limits = store.read_limits()
    assert limits is not None
    assert (limits.default_rate, limits.user_rates) == (50.0, {"x": 2.5})
    ex = ask(store, "a", 10, LeaseAsk("x", 1), LeaseAsk("gold", 1))
    assert ex.limits_version == 2 and ex.rates == {"x": 2.5, "gold": 50.0}


def test_a_tables_members_are_seeded_updated_and_read_with_its_limits(
    redis_server: RedisServer,
) -> None:
    """A teams' table: each member's team beside the teams' limits, seeded
    once, changed in the same versioned update as the limits, and read back
    with them; a user's name that looks like a field of the table stays a
    name."""
    client = RedisLeaseStore(
        StoreSettings(url=redis_server.url, key_prefix="teams-" + str(id(object())))
    )
    try:
        assert client.seed_limits(10.0, {"t": 30.0}, members={"a": "t", "u:x": "t"})
        assert not client.seed_limits(10.0, {}, members={"zz": "t"})
        limits = client.read_limits()
        assert limits is not None
        assert limits.user_rates == {"t": 30.0}
        assert limits.members == {"a": "t", "u:x": "t"}
        version = client.update_limits(
            default_rate=None,
            user_rates={"s": 5.0},
            remove_users=[],
            members={"b": "s", "a": "s"},
            remove_members=["u:x"],
        )
        limits = client.read_limits()
        assert limits is not None and limits.version == version == 2
        assert limits.user_rates == {"t": 30.0, "s": 5.0}
        assert limits.members == {"a": "s", "b": "s"}
    finally:
        client.close()


def test_a_store_without_limits_says_so(redis_server: RedisServer) -> None:
    client = RedisLeaseStore(
        StoreSettings(url=redis_server.url, key_prefix="empty-" + str(id(object())))
    )
    ex = client.exchange("a", [LeaseAsk("u", 1)], grace_us=GRACE)
    assert ex.limits_version == -1 and ex.rates == {}
    assert client.read_limits() is None
    # An update cannot leave half a table behind (no default): seed first.
    assert client.update_limits(default_rate=None, user_rates={"x": 1.0},
                                remove_users=[]) == -1  # fmt: skip
    assert client.read_limits() is None
    client.close()


def test_a_restarted_store_forgets_and_says_the_engine_is_fresh() -> None:
    with RedisServer() as server:
        client = RedisLeaseStore(StoreSettings(url=server.url, timeout_s=0.5))
        client.seed_limits(10.0, {})
        assert client.exchange("a", [], grace_us=GRACE).fresh
        assert not client.exchange("a", [], grace_us=GRACE).fresh
        server.kill()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            client.exchange("a", [], grace_us=GRACE)
        server.start()
        ex = client.exchange("a", [], grace_us=GRACE)
        assert ex.fresh and ex.limits_version == -1  # limits lost too
        client.close()


def test_an_unreachable_store_is_reported_with_its_redacted_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RedisLeaseStore(
        StoreSettings(url=f"redis://me:secret@127.0.0.1:{port}/0", timeout_s=0.2)
    )
    with pytest.raises(StoreUnavailable) as info:
        client.check()
    assert "secret" not in str(info.value) and "me:***@" in str(info.value)
    assert not isinstance(info.value, StoreIncompatible)


def test_a_server_that_is_not_redis_is_told_apart() -> None:
    """An HTTP server where the store should be."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(3):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = RedisLeaseStore(
        StoreSettings(url=f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    )
    with pytest.raises(StoreIncompatible, match="Redis-compatible"):
        client.check()
    listener.close()
