"""The Redis/Valkey backend of the shared budget store (no vLLM import).

``RedisLeaseStore`` implements ``messages.LeaseStore``, each call one round
trip. One Lua script decides a whole refresh of one engine (``exchange``): it
registers the engine (a heartbeat), and for each user the engine asks about
it divides that user's limit between the engines that hold a lease for it
(weighted max-min fair, granted only out of what the other engines' leases
leave free) and returns this engine's share. Lua scripts run atomically, so
no two engines ever divide the same user's limit at once. Two more scripts
seed the stored limits (only into an empty store) and update them.

All keys are under one hash tag ``{PREFIX}`` (a cluster keeps them in one
slot). Times are the server's (``TIME``) unless the caller passes its own
clock, as the simulations in the tests do. Failures raise
``StoreUnavailable``, or ``StoreIncompatible`` for a server that is not
Redis-compatible with Lua scripting.

The keys, how a share is computed and how long a lowered rate stays
counted: docs/architecture.md, "The shared store".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis
import redis.exceptions

from vllm_output_rate.store.messages import (
    UNBOUNDED,
    Exchange,
    LeaseAsk,
    StoredLimits,
    StoreIncompatible,
    StoreUnavailable,
)
from vllm_output_rate.store.settings import StoreSettings, client_url

# The message types stay importable from here (older imports).
__all__ = [
    "UNBOUNDED",
    "Exchange",
    "LeaseAsk",
    "RedisLeaseStore",
    "StoreIncompatible",
    "StoreUnavailable",
    "StoredLimits",
]

# Numbers go to and come from Lua as strings: Redis truncates Lua numbers
# to integers in replies.
EXCHANGE_LUA = r"""
local engines_key, limits_key = KEYS[1], KEYS[2]
local prefix, engine = ARGV[1], ARGV[2]
local now
if ARGV[3] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[3])
end
local ttl, grace, n = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])

local fresh = 0
if not redis.call('ZSCORE', engines_key, engine) then fresh = 1 end
redis.call('ZREMRANGEBYSCORE', engines_key, '-inf', now)
redis.call('ZADD', engines_key, now + ttl, engine)
redis.call('PEXPIRE', engines_key, math.ceil(ttl / 1000) + 1000)
local n_engines = redis.call('ZCARD', engines_key)
local version = redis.call('HGET', limits_key, '_version')
local reply = {string.format('%d', now), version or '-1', n_engines, fresh}
if not version then return reply end
local default = redis.call('HGET', limits_key, '_default')

-- One token's spacing at a rate, in microseconds (capped at the lease).
local function spacing(rate)
  if rate <= 0 then return 0 end
  return math.min(math.ceil(1000000 / rate), ttl)
end
local function parse(value)
  local w, want, rate, old, old_until, expiry = string.match(
    value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  return {w = tonumber(w), want = tonumber(want), rate = tonumber(rate),
          old = tonumber(old), old_until = tonumber(old_until),
          expiry = tonumber(expiry)}
end
local function counted(e)
  if e.old_until > now and e.old > e.rate then return e.old end
  return e.rate
end
local function ratio(p)
  if p.want < 0 then return math.huge end
  return p.want / p.w
end
-- Weighted max-min fair share of `limit` for `me` among `parts`.
local function fair_share(limit, parts, me)
  table.sort(parts, function(a, b) return ratio(a) < ratio(b) end)
  local remaining, wsum = limit, 0
  for _, p in ipairs(parts) do wsum = wsum + p.w end
  for _, p in ipairs(parts) do
    local fair = remaining * p.w / wsum
    if p.want >= 0 and p.want < fair then
      if p == me then return p.want end
      remaining = remaining - p.want
      wsum = wsum - p.w
    else
      return remaining * me.w / wsum
    end
  end
  return 0
end

local function lease_one(user, w, want)
  local key = prefix .. ':lease:' .. user
  local limit = tonumber(redis.call('HGET', limits_key, 'u:' .. user) or default)
  local raw = redis.call('HGETALL', key)
  local parts, holders, mine = {}, {}, nil
  local others, last_expiry = 0, now
  for i = 1, #raw, 2 do
    local e = parse(raw[i + 1])
    if raw[i] == engine then
      mine = e
    elseif e.expiry <= now then
      redis.call('HDEL', key, raw[i])
    else
      others = others + counted(e)
      last_expiry = math.max(last_expiry, e.expiry)
      if e.w > 0 then
        parts[#parts + 1] = {w = e.w, want = e.want}
        if e.rate > 0 then holders[#holders + 1] = raw[i] end
      end
    end
  end
  local rate, target = 0, 0
  if w > 0 then
    local me = {w = w, want = want}
    parts[#parts + 1] = me
    target = fair_share(limit, parts, me)
    rate = math.min(target, limit - others)
    rate = math.max(0, math.floor(rate * 1000) / 1000)
  end
  -- What this engine may still be using stays counted for the grace.
  -- (One pair keeps both an earlier lowering still in its grace and this
  -- one: the larger rate until the later end, which never counts less.)
  local old, old_until = 0, 0
  if mine and mine.expiry > now then
    if mine.old_until > now then old, old_until = mine.old, mine.old_until end
    if rate < mine.rate then
      old = math.max(old, mine.rate)
      old_until = math.max(old_until, now + grace + spacing(mine.rate))
    end
  end
  local expiry = now + ttl + grace + spacing(rate)
  if w == 0 then expiry = old_until end
  if w == 0 and old_until <= now then
    redis.call('HDEL', key, engine)
  else
    redis.call('HSET', key, engine, string.format('%s|%s|%.3f|%.3f|%d|%d',
      w, want, rate, old, old_until, expiry))
    last_expiry = math.max(last_expiry, expiry)
  end
  if last_expiry > now then
    redis.call('PEXPIRE', key, math.ceil((last_expiry - now) / 1000) + 1000)
  end
  if rate < target then
    -- Capacity this engine is owed is held by others: have them renew now.
    for _, holder in ipairs(holders) do
      local renew_key = prefix .. ':renew:' .. holder
      redis.call('SADD', renew_key, user)
      redis.call('PEXPIRE', renew_key, math.ceil(ttl / 1000) + 1000)
    end
  end
  local shared = 0
  if #parts > 1 then shared = 1 end
  reply[#reply + 1] = user
  reply[#reply + 1] = string.format('%.3f', rate)
  reply[#reply + 1] = shared
  return mine
end

local asked = {}
for i = 0, n - 1 do
  local user = ARGV[7 + 3 * i]
  asked[user] = true
  lease_one(user, tonumber(ARGV[8 + 3 * i]), tonumber(ARGV[9 + 3 * i]))
end
-- Users another engine waits for: renew them with what we last reported.
local renew_key = prefix .. ':renew:' .. engine
local waiting = redis.call('SMEMBERS', renew_key)
redis.call('DEL', renew_key)
for _, user in ipairs(waiting) do
  if not asked[user] then
    local value = redis.call('HGET', prefix .. ':lease:' .. user, engine)
    if value then
      local e = parse(value)
      if e.w > 0 and e.expiry > now then lease_one(user, e.w, e.want) end
    end
  end
end
return reply
"""

# The table's fields: ``u:<user>`` a limit, ``m:<member>`` a member's group
# (a teams' table), ``_default`` and ``_version``. The scripts take fields
# named whole.
USER_FIELD, MEMBER_FIELD = "u:", "m:"

# Write the limits only where there are none yet (a new or restarted store).
# ARGV: default, (field, value)...
SEED_LUA = r"""
if redis.call('HEXISTS', KEYS[1], '_version') == 1 then return 0 end
redis.call('HSET', KEYS[1], '_default', ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], '_version', 1)
return 1
"""

# ARGV: default ('' to keep), number of fields set, (field, value)...,
# fields removed...
UPDATE_LUA = r"""
if redis.call('HEXISTS', KEYS[1], '_version') == 0 then return -1 end
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], '_default', ARGV[1]) end
local n = tonumber(ARGV[2])
for i = 0, n - 1 do
  redis.call('HSET', KEYS[1], ARGV[3 + 2 * i], ARGV[4 + 2 * i])
end
for i = 3 + 2 * n, #ARGV do
  redis.call('HDEL', KEYS[1], ARGV[i])
end
return redis.call('HINCRBY', KEYS[1], '_version', 1)
"""


def _fmt(rate: float) -> str:
    return repr(float(rate))


class RedisLeaseStore:
    """Leases and limits in a Redis-compatible server, one round trip each."""

    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self._client = redis.Redis.from_url(
            client_url(settings.url),
            password=settings.password,
            socket_timeout=settings.timeout_s,
            socket_connect_timeout=settings.timeout_s,
            decode_responses=True,
            # One attempt: a retry would exceed the timeout the lease
            # arithmetic counts on; the refresher tries again next cycle.
            retry_on_timeout=False,
        )
        prefix = "{" + settings.key_prefix + "}"
        self._prefix = prefix
        self._engines_key = f"{prefix}:engines"
        self._limits_key = f"{prefix}:limits"
        self._exchange = self._client.register_script(EXCHANGE_LUA)
        self._seed = self._client.register_script(SEED_LUA)
        self._update = self._client.register_script(UPDATE_LUA)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (
            redis.exceptions.ResponseError,
            redis.exceptions.InvalidResponse,
        ) as exc:
            raise StoreIncompatible(
                f"store {self.settings.display_url} refused {what} ({exc}): is it a "
                "Redis-compatible server with Lua scripting (Redis >= 6.2, Valkey)?"
            ) from None
        except redis.exceptions.RedisError as exc:
            raise StoreUnavailable(
                f"store {self.settings.display_url} unreachable ({what}): "
                f"{type(exc).__name__}: {exc}"
            ) from None
        except OSError as exc:
            raise StoreUnavailable(
                f"store {self.settings.display_url} unreachable ({what}): {exc}"
            ) from None

    def check(self) -> str:
        """Ping the store and load the scripts; return the server's version.

        Raises StoreUnavailable when it is unreachable or is not a
        Redis-compatible server with Lua scripting.
        """
        self._call("PING", self._client.ping)
        for script in (self._exchange, self._seed, self._update):
            self._call("SCRIPT LOAD", self._client.script_load, script.script)
        info = self._call("INFO server", self._client.info, "server")
        return str(info.get("valkey_version") or info.get("redis_version", "?"))

    def exchange(
        self,
        engine: str,
        asks: Sequence[LeaseAsk],
        *,
        grace_us: int,
        now_us: int | None = None,
    ) -> Exchange:
        """Heartbeat and lease shares for ``asks``, atomically."""
        args: list[Any] = [
            self._prefix,
            engine,
            "" if now_us is None else str(int(now_us)),
            str(round(self.settings.lease_s * 1e6)),
            str(int(grace_us)),
            str(len(asks)),
        ]
        for ask in asks:
            args += [ask.user, _fmt(ask.weight), _fmt(ask.want)]
        raw = self._call(
            "the lease script",
            self._exchange,
            keys=[self._engines_key, self._limits_key],
            args=args,
        )
        try:
            now, version, engines, fresh = raw[:4]
            rates: dict[str, float] = {}
            shared: set[str] = set()
            for i in range(4, len(raw), 3):
                user, rate, is_shared = raw[i : i + 3]
                rates[user] = float(rate)
                if int(is_shared):
                    shared.add(user)
            return Exchange(
                int(now),
                int(version),
                int(engines),
                bool(int(fresh)),
                rates,
                frozenset(shared),
            )
        except (TypeError, ValueError) as exc:
            raise StoreIncompatible(
                f"store {self.settings.display_url} gave an unexpected reply to "
                f"the lease script ({exc}): is it a Redis-compatible server?"
            ) from None

    def seed_limits(
        self,
        default_rate: float,
        user_rates: Mapping[str, float],
        members: Mapping[str, str] | None = None,
    ) -> bool:
        """Store these limits (and members) unless the store has some; True
        if stored."""
        args = [_fmt(default_rate)]
        for user, rate in user_rates.items():
            args += [USER_FIELD + user, _fmt(rate)]
        for member, group in (members or {}).items():
            args += [MEMBER_FIELD + member, group]
        return bool(
            self._call("seeding limits", self._seed, keys=[self._limits_key], args=args)
        )

    def update_limits(
        self,
        *,
        default_rate: float | None,
        user_rates: Mapping[str, float],
        remove_users: Sequence[str],
        members: Mapping[str, str] | None = None,
        remove_members: Sequence[str] = (),
    ) -> int:
        """Apply a change to the stored limits (and members), in one new
        version; return it, or -1 when the store holds no limits (seed them
        first)."""
        fields = [(USER_FIELD + user, _fmt(rate)) for user, rate in user_rates.items()]
        fields += [(MEMBER_FIELD + m, group) for m, group in (members or {}).items()]
        args: list[str] = ["" if default_rate is None else _fmt(default_rate)]
        args.append(str(len(fields)))
        for name, value in fields:
            args += [name, value]
        args += [USER_FIELD + user for user in remove_users]
        args += [MEMBER_FIELD + member for member in remove_members]
        return int(
            self._call(
                "a limits update", self._update, keys=[self._limits_key], args=args
            )
        )

    def read_limits(self) -> StoredLimits | None:
        """The stored limits, or None when the store holds none."""
        table = self._call("reading limits", self._client.hgetall, self._limits_key)
        if "_version" not in table or "_default" not in table:
            return None
        users = {
            key[2:]: float(value)
            for key, value in table.items()
            if key.startswith(USER_FIELD)
        }
        members = {
            key[2:]: value
            for key, value in table.items()
            if key.startswith(MEMBER_FIELD)
        }
        return StoredLimits(
            int(table["_version"]), float(table["_default"]), users, members
        )

    def leave(self, engine: str) -> None:
        """Deregister (a clean shutdown); leases lapse on their own."""
        self._call("ZREM", self._client.zrem, self._engines_key, engine)

    def close(self) -> None:
        self._client.close()
