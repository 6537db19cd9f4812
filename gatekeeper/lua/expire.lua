-- expire.lua: a free attempt still waiting when its wait allowance ran out is moved to
-- reserved (SPEC section 2): its `expired` row, charged the allowance's wait, no tokens.
--
-- Called by the worker's main process before it acks a free message (gatekeeper/celery/
-- expiry.py), which then republishes the message to reserved. Only for the gate's message
-- (its nonce is the record's), admitted to free, never started, past its allowance. The
-- record then says reserved (reason free_wait_expired): the republished copy, which keeps the
-- nonce, runs there with a reserved row of its own. Sent again (a crash before the
-- republish, a redelivery) it writes nothing more and answers 'again', so the message is
-- republished rather than lost (it may then run twice, never zero times).
--
-- KEYS[1] run:<job_id>:<attempt>    hash: the gate's record (nonce, decision, admitted_ms,
--                                   window, reserved, charged, runs)
-- KEYS[2] inflight                  hash: <job_id>:<attempt> -> "<reserved>|<window>|<ms>|..."
-- KEYS[3] free:waiting              sorted set: admitted free attempts not yet started
-- KEYS[4] window:<admission window> hash: tax_units, rows:expired; exposure (or the entry's)
-- KEYS[5] window:<admission window>:rows  list: ledger rows
--
-- ARGV[1] member <job_id>:<attempt>   ARGV[2] nonce (the message's)   ARGV[3] now_ms
-- ARGV[4] allowance_ms   ARGV[5] unit (queue_wait_unit_per_second)   ARGV[6] retention_s
-- ARGV[7] the row's JSON without its last field (retry_tax) and closing brace
-- ARGV[8] the admission window the message names (KEYS[4]): it must be the record's
-- ARGV[9] '1': withdrawn now, whatever its wait (the replayer: the free path closed before a
--         recalled admission reached free), charged the wait so far; else '' or none
--
-- Returns 'expired' (moved now), 'again' (moved before, its copy not yet run: republish),
-- 'done' (moved before and its copy ran: this one is a spare, acked and not run) or 'no'
-- (not the gate's free message, started, or within its allowance: it runs where it is).

local r = redis.call('HMGET', KEYS[1], 'nonce', 'decision', 'reason', 'admitted_ms', 'runs',
  'reserved', 'charged', 'window')
if ARGV[2] == '' or r[1] ~= ARGV[2] then return 'no' end
if r[2] == 'reserved' and r[3] == 'free_wait_expired' then
  return r[5] and 'done' or 'again'  -- done: the copy on reserved ran; this one is spare
end
if r[2] ~= 'admit_free' or r[5] or r[8] ~= ARGV[8] then return 'no' end
local waited = tonumber(ARGV[3]) - tonumber(r[4] or ARGV[3])
local allowance = tonumber(ARGV[4])
if ARGV[9] == '1' then  -- withdrawn: not once a free copy was taken by a worker (take.lua)
  if redis.call('HGET', KEYS[1], 'taken:admit_free') then return 'no' end
elseif waited < allowance then
  return 'no'
end
local tax = math.min(math.max(waited, 0), allowance) * tonumber(ARGV[5]) / 1000
if r[6] then tax = math.min(tax, math.max(0, tonumber(r[6]) - tonumber(r[7] or '0'))) end
-- The reservation goes back to the window the in-flight entry names (KEYS[4] for an older
-- entry that names none; another's key built as release.lua builds it: an admission scored
-- again in a later window keeps its first entry), only while that window still holds it,
-- asked before anything is written (a key not in KEYS, which a cluster moving the slot may
-- refuse; and the row makes KEYS[4] again): one gone past its retention took it along (the
-- row makes it again, under the row's TTL, with no exposure).
local held = redis.call('HGET', KEYS[2], ARGV[1])
local exposed = false
if held then
  local win = string.match(held, '^[^|]+|(%d+)')
  exposed = win and string.match(KEYS[2], '^[^{]*{[^}]*}') .. ':window:' .. win or KEYS[4]
  exposed = redis.call('HGET', exposed, 'exposure') and exposed
end
-- `free_window`: the admission's window, where a slack miss of its job is counted
-- (gatekeeper/redis/owner.py), once `window` no longer says it.
redis.call('HSET', KEYS[1], 'decision', 'reserved', 'reason', 'free_wait_expired',
  'window', '', 'expired_ms', ARGV[3], 'free_window', r[8])
local charged = redis.call('HINCRBYFLOAT', KEYS[1], 'charged', tax)
redis.call('HSET', KEYS[1], 'reserved', charged)  -- closed: its runs on reserved charge nothing
local retention = tonumber(ARGV[6])
redis.call('HINCRBYFLOAT', KEYS[4], 'tax_units', tax)
redis.call('HINCRBY', KEYS[4], 'rows:expired', 1)
redis.call('EXPIRE', KEYS[4], retention)
redis.call('RPUSH', KEYS[5], ARGV[7] .. ', "retry_tax": ' .. string.format('%.17g', tax) .. '}')
redis.call('EXPIRE', KEYS[5], retention)
if held then
  redis.call('HDEL', KEYS[2], ARGV[1])
  if exposed then
    redis.call('HINCRBYFLOAT', exposed, 'exposure', -tonumber(string.match(held, '^[^|]+')))
  end
end
redis.call('ZREM', KEYS[3], ARGV[1])
return 'expired'
