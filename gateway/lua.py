"""The store's Lua scripts: every read-then-write on a conversation, atomic, in one round trip.

Each runs over keys that share the conversation's hash tag (keys.py), so it runs unchanged on
Redis Cluster, and under fakeredis for `memory://`. Field names are written `${NAME}` and filled
in from keys.py's constants (`filled`), so a stored field is spelled in one place.
"""

from __future__ import annotations

import string

from gateway import keys as fields

# The field-name constants of keys.py, as `${NAME}` in the scripts below.
_FIELDS_BY_NAME = {name: value for name, value in vars(fields).items()
                   if name.isupper() and name.split("_")[0] in ("META", "SUMMARY", "STATE", "RECORD")}


def filled(script: str) -> str:
    """`script` with its `${NAME}` field names filled in (a missing name raises: the store does not start)."""
    return string.Template(script).substitute(_FIELDS_BY_NAME)


# Every conversation script gets the conversation's keys in this order (keys.conversation_keys),
# so it can refresh the TTL of all of them: 1 meta, 2 msgs, 3 chains, 4 summary, 5 stats, 6 state,
# 7 branches (one JSON descriptor per abandoned branch), 8 abandoned (their messages' records).
TOUCH = """
local function touch(ttl)
  if ttl > 0 then for i = 1, 8 do redis.call('EXPIRE', KEYS[i], ttl) end end
end
"""

# The optimistic check of append and branch: the history still has `chain` at position pos-1.
# Both answer {ok, length, appended, reason, last chain, start, summary version, state version,
# fold-queued flag, summarizer stats}: the last four tell the caller whether what it knows of the
# conversation is current (KEYS[sk] is the state hash when it lives in this slot, sk 0 when not).
BASE = """
local function on_base(len, pos, chain)
  return pos <= len and (pos == 0 or redis.call('LINDEX', KEYS[3], pos - 1) == chain)
end
local function answer(ok, len, appended, reason, last, start, sk)
  local state = -1
  if sk > 0 then state = tonumber(redis.call('HGET', KEYS[sk], '${STATE_VERSION}')) or 0 end
  return {ok, len, appended, reason, last, start,
          tonumber(redis.call('HGET', KEYS[4], '${SUMMARY_VERSION}')) or 0, state,
          redis.call('HGET', KEYS[1], '${META_FOLD_QUEUED}') or '',
          redis.call('HMGET', KEYS[5], 'summarizer_tokens_in', 'summarizer_tokens_out', 'summarizer_tokens_charged')}
end
local function refused(len, sk)
  return answer(0, len, 0, 'branched', redis.call('HGET', KEYS[1], '${META_LAST_CHAIN}') or '', -1, sk)
end
"""

# Stats ride along with the append or branch that records a turn (one round trip, not two): ARGV[at]
# is the number k of (name, increment) pairs that follow; the turns' pairs start at ARGV[at + 1 + 2k].
# Added whatever the outcome of the base check, as a separate add_stats would be.
STATS = """
local function add_stats(ttl, at)
  local k = tonumber(ARGV[at])
  for i = 1, k do redis.call('HINCRBY', KEYS[5], ARGV[at - 1 + 2 * i], ARGV[at + 2 * i]) end
  if k > 0 and ttl > 0 then redis.call('EXPIRE', KEYS[5], ttl) end
  return at + 1 + 2 * k
end
"""

# Appends the n (hash, record) pairs from ARGV[off] after chain `prev`; returns the new last chain
# and the pushed messages' tokens (each record starts with {"k":tokens). RPUSH in batches: Lua
# 5.1's unpack() is bounded by the C stack (~8000 values).
PUSH = """
local function push(prev, off, n)
  local recs, chs, tokens = {}, {}, 0
  for i = 1, n do
    local rec = ARGV[off + 2 * i - 1]
    prev = redis.sha1hex(prev .. ARGV[off + 2 * i - 2])
    chs[#chs + 1] = prev
    recs[#recs + 1] = string.sub(rec, 1, -2) .. ',"${RECORD_CHAIN}":"' .. prev .. '"}'
    tokens = tokens + (tonumber(string.match(rec, '^{"${RECORD_TOKENS}":(%d+)')) or 0)
    if #chs == 1000 or i == n then
      redis.call('RPUSH', KEYS[2], unpack(recs))
      redis.call('RPUSH', KEYS[3], unpack(chs))
      recs, chs = {}, {}
    end
  end
  return prev, tokens
end
"""

# KEYS: the eight conversation keys (+ 9: project state when it may be read here).
# ARGV: head, ttl, index of the state key in KEYS (0: do not read state).
LOAD = TOUCH + """
local head, ttl, sk = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local len = redis.call('LLEN', KEYS[3])
local meta = redis.call('HMGET', KEYS[1], '${META_DIALECT}', '${META_FIRST_HASH}', '${META_LAST_CHAIN}',
                        '${META_TOKENS}', '${META_FOLD_QUEUED}', '${META_CLIENT}')
local summ = redis.call('HMGET', KEYS[4], '${SUMMARY_VERSION}', '${SUMMARY_TEXT}', '${SUMMARY_COVERS}',
                        '${SUMMARY_TOKENS}', '${SUMMARY_CHAIN}')
local covers = 0
if summ[2] then covers = math.min(tonumber(summ[3]) or 0, len) end
local h = math.min(head, covers)
local first = {}
if h > 0 then first = redis.call('LRANGE', KEYS[2], 0, h - 1) end
local tail = {}
if len > covers then tail = redis.call('LRANGE', KEYS[2], covers, -1) end
local state = {}
if sk > 0 then
  state = redis.call('HMGET', KEYS[sk], '${STATE_LEDGER}', '${STATE_VERSION}')
  if ttl > 0 and sk > 8 then redis.call('EXPIRE', KEYS[sk], ttl) end
end
if len > 0 then touch(ttl) end
return {len, meta, summ, state, first, tail, redis.call('HGETALL', KEYS[5]), covers}
"""

# KEYS: the conversation keys (+ 9: project state, as for LOAD).
# ARGV: ttl, base_length, base_chain, dialect, state index (see BASE), own (how many of the run's
# last turns are the request's own: its new turn and the reply, not history it resent), the client's
# history style seen by this request ("" when it shows none), stats (see STATS, from ARGV[8]), then
# (hash, record) pairs: the run of turns to store after message base_length-1.
APPEND = TOUCH + STATS + PUSH + BASE + """
local ttl, base, bchain, sk, own = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[5]), tonumber(ARGV[6])
local off = add_stats(ttl, 8)
local n = (#ARGV - off + 1) / 2
local len = redis.call('LLEN', KEYS[3])
if not on_base(len, base, bchain) then return refused(len, sk) end
local seg = {}
if n > 0 and len > base then seg = redis.call('LRANGE', KEYS[3], base, -1) end
-- A base behind the store: the caller planned from what it knew before an append of this same
-- history landed (its own previous request, recorded meanwhile). What is already stored right
-- after the base is not stored again; the rest of the run goes on from there.
local skip, prev = 0, bchain
while skip < n and skip < #seg do
  local c = redis.sha1hex(prev .. ARGV[off + 2 * skip])
  if c ~= seg[skip + 1] then break end
  prev, skip = c, skip + 1
end
local m, first, at = n - skip, off + 2 * skip, base + skip
if m == 0 then
  touch(ttl)
  return answer(1, len, 0, '', redis.call('HGET', KEYS[1], '${META_LAST_CHAIN}') or '', base, sk)
end
-- Idempotent retry: the rest of the run already stored anywhere after `at` (a retried request
-- whose first attempt was recorded, possibly after concurrent requests' turns).
if len - at >= m then
  for s = 0, len - at - m do
    local p = prev
    if s > 0 then p = seg[skip + s] end
    local i = 1
    while i <= m and redis.sha1hex(p .. ARGV[first + 2 * i - 2]) == seg[skip + s + i] do
      p = seg[skip + s + i]
      i = i + 1
    end
    if i > m then
      touch(ttl)
      return answer(1, len, 0, '', redis.call('HGET', KEYS[1], '${META_LAST_CHAIN}') or '', at + s, sk)
    end
  end
end
-- Concurrent requests built on the same base land after whatever is stored now: their own turns
-- only. A run that also carries resent history the store holds otherwise (in another order, or
-- not at all) is the request's own branch: refused, so the caller decides again on what is stored
-- now (placing it after the others' turns would store that history twice).
if len > at then
  if m > own then return refused(len, sk) end
  prev = seg[#seg]
end
local last, tokens = push(prev, first, m)
if len == 0 then redis.call('HSET', KEYS[1], '${META_FIRST_HASH}', ARGV[off]) end
redis.call('HSET', KEYS[1], '${META_DIALECT}', ARGV[4], '${META_LAST_CHAIN}', last)
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], '${META_CLIENT}', ARGV[7]) end
redis.call('HINCRBY', KEYS[1], '${META_TOKENS}', tokens)
touch(ttl)
return answer(1, len + m, m, '', last, len, sk)
"""

# ARGV: ttl, at, base_chain, dialect, state index, stats (see STATS), then (hash, record) pairs.
# Messages [at, len) are not deleted: they are moved, records as stored (chains included), to the
# end of KEYS[8], and a descriptor of that branch is pushed on KEYS[7]: its number (1-based, its
# position in KEYS[7]), where it left the history (`at`, and the chain at at-1), where its records
# start in KEYS[8] and how many, when (unix seconds), its tokens.
BRANCH = TOUCH + STATS + PUSH + BASE + """
local ttl, at, bchain, sk = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[5])
local off = add_stats(ttl, 6)
local n = (#ARGV - off + 1) / 2
local len = redis.call('LLEN', KEYS[3])
if not on_base(len, at, bchain) then return refused(len, sk) end
local dropped = 0
if at < len then
  local recs = redis.call('LRANGE', KEYS[2], at, -1)
  for _, rec in ipairs(recs) do
    dropped = dropped + (tonumber(string.match(rec, '^{"${RECORD_TOKENS}":(%d+)')) or 0)
  end
  local start = redis.call('LLEN', KEYS[8])
  for i = 1, #recs, 1000 do redis.call('RPUSH', KEYS[8], unpack(recs, i, math.min(i + 999, #recs))) end
  local id = redis.call('LLEN', KEYS[7]) + 1
  redis.call('RPUSH', KEYS[7], '{"id":' .. id .. ',"at":' .. at .. ',"chain":"' .. bchain .. '","start":' .. start ..
             ',"count":' .. #recs .. ',"time":' .. redis.call('TIME')[1] .. ',"tokens":' .. dropped .. '}')
  if at == 0 then
    redis.call('DEL', KEYS[2], KEYS[3])
  else
    redis.call('LTRIM', KEYS[2], 0, at - 1)
    redis.call('LTRIM', KEYS[3], 0, at - 1)
  end
end
local covers = tonumber(redis.call('HGET', KEYS[4], '${SUMMARY_COVERS}'))
if covers and covers > at then
  -- The summary stands for messages of the abandoned branch: drop it, keep the version growing.
  redis.call('HDEL', KEYS[4], '${SUMMARY_TEXT}', '${SUMMARY_COVERS}', '${SUMMARY_TOKENS}', '${SUMMARY_CHAIN}',
             '${SUMMARY_EDITED}', '${SUMMARY_PINNED}', '${SUMMARY_PINNED_TOKENS}')
  redis.call('HINCRBY', KEYS[4], '${SUMMARY_VERSION}', 1)
end
local last, tokens = bchain, 0
if at == 0 then last = '' end
if n > 0 then last, tokens = push(last, off, n) end
if at == 0 and n > 0 then redis.call('HSET', KEYS[1], '${META_FIRST_HASH}', ARGV[off]) end
if at + n == 0 then
  redis.call('HDEL', KEYS[1], '${META_FIRST_HASH}', '${META_LAST_CHAIN}')
else
  redis.call('HSET', KEYS[1], '${META_LAST_CHAIN}', last)
end
redis.call('HSET', KEYS[1], '${META_DIALECT}', ARGV[4])
redis.call('HINCRBY', KEYS[1], '${META_TOKENS}', tokens - dropped)
touch(ttl)
return answer(1, at + n, n, '', last, at, sk)
"""

# ARGV: ttl, expect_version, covers, chain, text, tokens, unix time of the commit.
COMMIT_FOLD = TOUCH + """
local ttl, covers = tonumber(ARGV[1]), tonumber(ARGV[3])
local cur = redis.call('HMGET', KEYS[4], '${SUMMARY_VERSION}', '${SUMMARY_TEXT}')
local v = tonumber(cur[1]) or 0
if cur[2] and v ~= tonumber(ARGV[2]) then return 0 end
if covers > 0 then
  if redis.call('LINDEX', KEYS[3], covers - 1) ~= ARGV[4] then return 0 end
elseif ARGV[4] ~= '' then
  return 0
end
-- A hand edit stays (the fold kept its text at the head): the summary is still partly the user's.
local edited = redis.call('HEXISTS', KEYS[4], '${SUMMARY_PINNED}')
redis.call('HSET', KEYS[4], '${SUMMARY_VERSION}', v + 1, '${SUMMARY_TEXT}', ARGV[5], '${SUMMARY_COVERS}', covers,
           '${SUMMARY_TOKENS}', ARGV[6], '${SUMMARY_CHAIN}', ARGV[4], '${SUMMARY_EDITED}', edited,
           '${SUMMARY_FOLDED_AT}', ARGV[7])
touch(ttl)
return v + 1
"""

# ARGV: ttl, text, tokens. Returns {version, covers, chain}.
PUT_SUMMARY = TOUCH + """
local cur = redis.call('HMGET', KEYS[4], '${SUMMARY_VERSION}', '${SUMMARY_TEXT}', '${SUMMARY_COVERS}',
                       '${SUMMARY_CHAIN}')
local v = (tonumber(cur[1]) or 0) + 1
local covers, chain = 0, ''
if cur[2] then covers, chain = tonumber(cur[3]) or 0, cur[4] or '' end
redis.call('HSET', KEYS[4], '${SUMMARY_VERSION}', v, '${SUMMARY_TEXT}', ARGV[2], '${SUMMARY_COVERS}', covers,
           '${SUMMARY_TOKENS}', ARGV[3], '${SUMMARY_CHAIN}', chain, '${SUMMARY_EDITED}', 1,
           '${SUMMARY_PINNED}', ARGV[2], '${SUMMARY_PINNED_TOKENS}', ARGV[3])
touch(tonumber(ARGV[1]))
return {v, covers, chain}
"""

# KEYS: the state key. ARGV: ttl, expected version ('' = unconditional), ledger JSON.
PUT_STATE = """
local v = tonumber(redis.call('HGET', KEYS[1], '${STATE_VERSION}')) or 0
if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= v then return 0 end
redis.call('HSET', KEYS[1], '${STATE_LEDGER}', ARGV[3], '${STATE_VERSION}', v + 1)
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return v + 1
"""

# KEYS: stats, meta. ARGV: ttl, then the pairs as in STATS (counted from ARGV[2]). Nothing for a
# conversation that is not stored (deleted while a fold ran: its stats would stay behind, alone).
ADD_STATS = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local k = tonumber(ARGV[2])
for i = 1, k do redis.call('HINCRBY', KEYS[1], ARGV[1 + 2 * i], ARGV[2 + 2 * i]) end
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return k
"""

# KEYS: meta. ARGV: now (ms), stale after (ms), ttl. A flag older than `stale` is a lost job.
ENQUEUE = """
local q = tonumber(redis.call('HGET', KEYS[1], '${META_FOLD_QUEUED}'))
if q and tonumber(ARGV[1]) - q < tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], '${META_FOLD_QUEUED}', ARGV[1])
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
"""
