"""The shared budget's atomic scripts (Lua, run by Redis one at a time: each is one decision across instances).

Keys, under the prefix ``P`` and the budget's generation ``G`` (``P..'gen'``; a Redis that lost its data has none,
and the instances start a new one from what they hold, :data:`RECOVER`)::

    P..G..':e:'..E..':D'      D of engine E (an integer)
    P..G..':e:'..E..':adm'    its admitted sessions: sid -> d_s
    P..G..':e:'..E..':fifo'   its held sessions, oldest first (re-admission order, shared by all instances)
    P..G..':e:'..E..':held'   sid -> "d_s owner turn" of each held session
    P..G..':run'              sessions with a turn in flight: sid -> "owner engine turn" (the lease's holder)
    P..G..':lease'            sid -> when the lease ends (ms); renewed by the holder's heartbeat
    P..G..':own:'..O          the sessions whose lease instance O holds
    P..G..':await'            instances a recovery still waits for (no admission until they are back or late)
    P..'place'                sid -> the engine (replica) its turns go to, chosen by ASK (least D_r/C_r of the
                              engines the caller sees up); it outlives a generation, and goes with the session
    P..'cap'                  engine -> C_r, as the instances last read its pool
    P..'inst'                 live instances: id -> last heartbeat (ms)
    P..'notify:'..O           held turns of O the pump admitted: "G sid d_s turn" (O pops them)

A fleet is one budget per engine: D_r, its admitted set and its FIFO, each decision keyed by the session's engine.
Every script takes ``ARGV[1] = P`` and ``ARGV[2] = G`` (the generation the caller knows) and answers
``{'stale', G'}`` when the budget has moved to another generation (or Redis lost it), so the caller recovers."""

from __future__ import annotations

_HEAD = r"""
local P = ARGV[1]
local gen = redis.call('GET', P..'gen')
if (not gen) or gen ~= ARGV[2] then return {'stale', gen or ''} end
local B = P..gen..':'
local function E(e) return B..'e:'..e..':' end

local function awaiting(now)
  if redis.call('SCARD', B..'await') == 0 then return false end
  if now >= tonumber(redis.call('GET', B..'await_until') or '0') then
    redis.call('DEL', B..'await')
    return false
  end
  return true
end

local function cap(e, dflt)
  return tonumber(redis.call('HGET', P..'cap', e) or dflt or '0')
end

local function pump(e, C, now, lease)
  local out = {}
  if awaiting(now) then return out end
  local k = E(e)
  C = cap(e, C)
  while true do
    local sid = redis.call('LINDEX', k..'fifo', 0)
    if not sid then break end
    local h = redis.call('HGET', k..'held', sid)
    local d, owner, turn = string.match(h, '^(%S+) (%S+) (%S+)$')
    d = tonumber(d)
    local D = tonumber(redis.call('GET', k..'D') or '0')
    if redis.call('HLEN', k..'adm') > 0 and D + d > C then break end
    redis.call('LPOP', k..'fifo')
    redis.call('HDEL', k..'held', sid)
    redis.call('HSET', k..'adm', sid, d)
    redis.call('INCRBY', k..'D', d)
    redis.call('HSET', B..'run', sid, owner..' '..e..' '..turn)
    redis.call('ZADD', B..'lease', now + lease, sid)
    redis.call('SADD', B..'own:'..owner, sid)
    redis.call('SADD', B..'owners', owner)
    redis.call('RPUSH', P..'notify:'..owner, gen..' '..sid..' '..d..' '..turn..' '..e)
    out[#out + 1] = sid
  end
  return out
end

local function leave(e, sid)  -- the session out of engine e's books; true if it was in them
  local k = E(e)
  local old = redis.call('HGET', k..'adm', sid)
  if old then
    redis.call('HDEL', k..'adm', sid)
    redis.call('DECRBY', k..'D', tonumber(old))
  end
  local held = redis.call('HDEL', k..'held', sid) == 1
  if held then redis.call('LREM', k..'fifo', 0, sid) end
  return old ~= false or held
end

local function unlease(sid)
  local r = redis.call('HGET', B..'run', sid)
  if r then
    local owner = string.match(r, '^(%S+)')
    redis.call('HDEL', B..'run', sid)
    redis.call('ZREM', B..'lease', sid)
    redis.call('SREM', B..'own:'..owner, sid)
  end
  return r
end
"""

_PLACE = r"""
-- ARGV: P G sid d owner turn now lease version hint, then the engines the caller sees up: engine C_r ...
local sid, d, owner, turn = ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local now, lease, version, hint = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9], ARGV[10]
local caps, order = {}, {}
for i = 11, #ARGV, 2 do
  caps[ARGV[i]] = tonumber(ARGV[i + 1])
  order[#order + 1] = ARGV[i]
  redis.call('HSET', P..'cap', ARGV[i], ARGV[i + 1])
end

-- the session's engine: where it is placed while the caller sees it up; else (new, or its engine down) the hint
-- (the engine of its last turns, placed again after Redis lost the placement) if up, else the least D_r/C_r
local function placed()
  local e = redis.call('HGET', P..'place', sid)
  if e and caps[e] then return e end
  if e then leave(e, sid) end  -- its engine is down: it leaves that engine's books
  if hint ~= '' and caps[hint] and hint ~= e then
    e = hint
  else
    local best, score = nil, nil
    for _, x in ipairs(order) do
      local kx = E(x)
      local load = (tonumber(redis.call('GET', kx..'D') or '0') + d * (1 + redis.call('LLEN', kx..'fifo')))
        / math.max(1, caps[x])
      if best == nil or load < score then best, score = x, load end
    end
    e = best
  end
  redis.call('HSET', P..'place', sid, e)
  return e
end
"""

ASK = _HEAD + _PLACE + r"""
local r = redis.call('HGET', B..'run', sid)
if r then
  local holder = string.match(r, '^(%S+)')
  local till = tonumber(redis.call('ZSCORE', B..'lease', sid) or '0')
  if holder ~= owner and till > now then return {'busy'} end
  unlease(sid)  -- its holder's retry, or a lease run out: the session is thinking
end
if version ~= '' and tonumber(redis.call('ZSCORE', P..'books:changed', sid) or '0') ~= tonumber(version)
then return {'moved'} end  -- the caller's book of the session is not the last one written: it reads it first
local e = placed()
local C, k = caps[e], E(e)
redis.call('SADD', B..'engines', e)
local h = redis.call('HGET', k..'held', sid)
if h then  -- held already (a retry, from any instance): it takes over the place
  redis.call('HSET', k..'held', sid, d..' '..owner..' '..turn)
  return {'park', e}
end
local function run()
  redis.call('HSET', B..'run', sid, owner..' '..e..' '..turn)
  redis.call('ZADD', B..'lease', now + lease, sid)
  redis.call('SADD', B..'own:'..owner, sid)
  redis.call('SADD', B..'owners', owner)
  return {'proceed', e}
end
local function park()
  redis.call('RPUSH', k..'fifo', sid)
  redis.call('HSET', k..'held', sid, d..' '..owner..' '..turn)
  return {'park', e}
end
local D = tonumber(redis.call('GET', k..'D') or '0')
local old = redis.call('HGET', k..'adm', sid)
if old then  -- admitted, thinking: its new demand counts; parked if D no longer fits (never the only one)
  D = D + d - tonumber(old)
  if D > C and redis.call('HLEN', k..'adm') > 1 then
    redis.call('HDEL', k..'adm', sid)
    redis.call('SET', k..'D', D - d)
    return park()
  end
  redis.call('HSET', k..'adm', sid, d)
  redis.call('SET', k..'D', D)
  return run()
end
if (not awaiting(now)) and redis.call('LLEN', k..'fifo') == 0
   and (redis.call('HLEN', k..'adm') == 0 or D + d <= C) then
  redis.call('HSET', k..'adm', sid, d)
  redis.call('SET', k..'D', D + d)
  return run()
end
return park()
"""

_FINISH = r"""
-- ARGV: P G engine C sid owner now lease aborted
local e, C, sid, owner, now, lease = ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local r = redis.call('HGET', B..'run', sid)
local mine = r and string.match(r, '^(%S+)') == owner
if r then e = string.match(r, '^%S+ (%S+)') or e end  -- (the engine the turn was admitted on)
local k = E(e)
if mine then
  unlease(sid)
  if ARGV[9] == '1' then  -- an aborted turn: its demand leaves D until its next boundary
    local old = redis.call('HGET', k..'adm', sid)
    if old then
      redis.call('DECRBY', k..'D', tonumber(old))
      redis.call('HSET', k..'adm', sid, 0)
    end
  end
end
local out = pump(e, C, now, lease)
table.insert(out, 1, mine and 'ok' or 'lost')
"""

_IF_IDLE = r"""
-- ARGV[8], when not '': the caller's version of the session's book; the session leaves only if it is idle (neither
-- held nor running, on any instance) and its book is still that one (an instance's copy of a session another
-- instance serves has gone idle there: nothing changes)
if ARGV[8] and ARGV[8] ~= '' then
  local s8 = ARGV[5]
  local k8 = E(redis.call('HGET', P..'place', s8) or ARGV[3])
  if redis.call('HEXISTS', B..'run', s8) == 1 or redis.call('HEXISTS', k8..'held', s8) == 1
     or tonumber(redis.call('ZSCORE', P..'books:changed', s8) or '0') ~= tonumber(ARGV[8]) then
    return {'busy'}
  end
end
"""

_END = r"""
-- ARGV: P G engine C sid now lease [idle-only: the caller's version of the book, or '']
local e, C, sid, now, lease = ARGV[3], tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
e = redis.call('HGET', P..'place', sid) or e
redis.call('HDEL', P..'place', sid)
unlease(sid)
local out = {}
for _, x in ipairs(redis.call('SMEMBERS', B..'engines')) do  -- (out of every engine's books: the one it is on)
  if leave(x, sid) or x == e then
    for _, p in ipairs(pump(x, C, now, lease)) do out[#out + 1] = p end
  end
end
table.insert(out, 1, 'ok')
"""

_BOOK = r"""
-- the session's book with its turn's end, the last three ARGV: sid, its row ('' : the session is gone), and an epoch
-- for a Redis that has none (a new one, or one that lost its data: the instances read all the books again)
local BK = P..'books:'
local bsid, brow = ARGV[#ARGV - 2], ARGV[#ARGV - 1]
local epoch = redis.call('GET', BK..'epoch')
if not epoch then
  epoch = ARGV[#ARGV]
  redis.call('SET', BK..'epoch', epoch)
end
local booked = redis.call('INCR', BK..'seq')
if brow == '' then redis.call('HDEL', BK..'sessions', bsid) else redis.call('HSET', BK..'sessions', bsid, brow) end
redis.call('ZADD', BK..'changed', booked, bsid)
"""

_BOOKED = """table.insert(out, 2, booked)
table.insert(out, 3, epoch)
return out
"""

FINISH = _HEAD + _FINISH + "return out\n"
END = _HEAD + _IF_IDLE + _END + "return out\n"
BOOK_FINISH = _HEAD + _BOOK + _FINISH + _BOOKED
"""FINISH with the session's book written in the same step: ``{status, its version, the books' epoch, ...}``."""
BOOK_END = _HEAD + _IF_IDLE + _BOOK + _END + _BOOKED
"""END with the session's book gone (``ARGV[8]`` as END's, then the book's three)."""

SYNC = r"""
-- ARGV: P last epoch fresh-epoch limit: the books changed after version ``last`` (all of them when the epoch is not
-- the caller's): {epoch, sid, version, row ('' : gone), ...}
local BK = ARGV[1]..'books:'
local epoch = redis.call('GET', BK..'epoch')
if not epoch then
  epoch = ARGV[4]
  redis.call('SET', BK..'epoch', epoch)
end
local last = tonumber(ARGV[2])
if epoch ~= ARGV[3] then last = -1 end
local got = redis.call('ZRANGEBYSCORE', BK..'changed', '('..last, '+inf', 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[5]))
local out = {epoch}
for i = 1, #got, 2 do
  out[#out + 1] = got[i]
  out[#out + 1] = got[i + 1]
  out[#out + 1] = redis.call('HGET', BK..'sessions', got[i]) or ''
end
return out
"""

PUT = "local P = ARGV[1]\n" + _BOOK + "return {booked, epoch}\n"
"""A session's book alone (ARGV: P sid row epoch): written again to a Redis that lost it."""

READ = r"""
-- ARGV: P sid: {version, row ('' : none)} of one session's book
local BK = ARGV[1]..'books:'
return {redis.call('ZSCORE', BK..'changed', ARGV[2]) or '0', redis.call('HGET', BK..'sessions', ARGV[2]) or ''}
"""

HEARTBEAT = _HEAD + r"""
-- ARGV: P G owner now ttl lease, then engine C_r ...: renew the owner's leases, reap the others' run out, pump
-- every engine
local owner, now, ttl, lease = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('ZADD', P..'inst', now, owner)
redis.call('ZREMRANGEBYSCORE', P..'inst', '-inf', now - ttl)
for _, sid in ipairs(redis.call('SMEMBERS', B..'own:'..owner)) do
  redis.call('ZADD', B..'lease', now + lease, sid)
end
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', B..'lease', '-inf', now)) do
  unlease(sid)  -- its instance is gone: the session goes back to thinking (its d_s stays in D)
end
local out = {redis.call('ZCARD', P..'inst')}
for i = 7, #ARGV, 2 do
  redis.call('HSET', P..'cap', ARGV[i], ARGV[i + 1])
  for _, sid in ipairs(pump(ARGV[i], tonumber(ARGV[i + 1]), now, lease)) do out[#out + 1] = sid end
end
return out
"""

RECOVER = r"""
-- ARGV: P G owner now ttl lease expected(comma-separated), then sid d turn engine of each of the owner's turns
local P, mygen, owner = ARGV[1], ARGV[2], ARGV[3]
local now, ttl, lease = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local cur = redis.call('GET', P..'gen')
local target
if (not cur) or cur == mygen then  -- the first back: a new generation, from what the instances hold
  target = tostring(math.max(tonumber(mygen) or 0, tonumber(cur) or 0) + 1)
  if cur then
    local O = P..cur..':'
    for _, o in ipairs(redis.call('SMEMBERS', O..'owners')) do redis.call('DEL', O..'own:'..o) end
    for _, ek in ipairs(redis.call('SMEMBERS', O..'engines')) do
      local k = O..'e:'..ek..':'
      redis.call('DEL', k..'D', k..'adm', k..'fifo', k..'held')
    end
    redis.call('DEL', O..'run', O..'lease', O..'owners', O..'engines', O..'await', O..'await_until')
  end
  redis.call('SET', P..'gen', target)
  local B = P..target..':'
  for o in string.gmatch(ARGV[7], '[^,]+') do
    if o ~= owner then redis.call('SADD', B..'await', o) end
  end
  redis.call('SET', B..'await_until', now + ttl)
else
  target = cur
end
local B = P..target..':'
redis.call('SREM', B..'await', owner)
for i = 8, #ARGV, 4 do
  local sid, d, turn, e = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local k = B..'e:'..e..':'
  redis.call('SADD', B..'engines', e)
  local was = redis.call('HGET', P..'place', sid)
  if was and was ~= e then  -- (placed on another engine meanwhile, and held there: its turn runs on e)
    local kw = B..'e:'..was..':'
    local old = redis.call('HGET', kw..'adm', sid)
    if old then
      redis.call('HDEL', kw..'adm', sid)
      redis.call('DECRBY', kw..'D', tonumber(old))
    end
    if redis.call('HDEL', kw..'held', sid) == 1 then redis.call('LREM', kw..'fifo', 0, sid) end
  end
  redis.call('HSET', P..'place', sid, e)
  if not redis.call('HGET', k..'adm', sid) then
    redis.call('HSET', k..'adm', sid, d)
    redis.call('INCRBY', k..'D', d)
  end
  redis.call('HSET', B..'run', sid, owner..' '..e..' '..turn)
  redis.call('ZADD', B..'lease', now + lease, sid)
  redis.call('SADD', B..'own:'..owner, sid)
end
redis.call('SADD', B..'owners', owner)
redis.call('ZADD', P..'inst', now, owner)
return {target, redis.call('SCARD', B..'await')}
"""
