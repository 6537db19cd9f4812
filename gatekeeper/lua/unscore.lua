-- unscore.lua: undo the replayer's decision of a deferred message that was never handed on.
--
-- The replayer scored the message (gate.lua or record.lua wrote a new nonce into the record,
-- and the message's as its prev_nonce), then no copy left: its handoff was not kept (refused,
-- or its pass killed or stopped before it). Only while the record still holds that decision
-- (its nonce: a replayer that stalled past its lock must not undo its successor's), this
-- script gives back what the decision admitted, as release.lua does for a message never
-- published (ARGV[5] = '1'), and makes the record the message's again, as parked: its nonce,
-- the decision `defer`, no prev_nonce and no admission window. The message, still carrying
-- its nonce, is then the record's deferred message for every later pass, also when it comes
-- back unmoved from a pass that stops before its next handoff (handoff.as_scored).
--
-- KEYS[1] run:<job_id>:<attempt>   hash: the gate's record of the attempt
-- KEYS[2] inflight                 hash: <job_id>:<attempt> -> "<reserved>|<window>|..."
-- KEYS[3] free:waiting             sorted set: admitted free attempts not yet started
-- KEYS[4] window:<admission window> hash: exposure, admitted_free (KEYS[1] when none)
--
-- ARGV[1] the decision's nonce (the record's now)   ARGV[2] the message's nonce
-- ARGV[3] free_admitted to write ('': left as it is)
-- ARGV[4] member <job_id>:<attempt>   ARGV[5] '1': the decision admitted it to free
-- ARGV[6] '1': the attempt was abandoned before the decision (a dead letter's requeue): it
--         is again (`abandoned`, which the decision cleared)
--
-- Returns 1 when undone; 0 when the record holds another nonce now, or a handoff was kept
-- for the message meanwhile (its copy may have left: keep.lua), and nothing changed.

local held = redis.call('HMGET', KEYS[1], 'nonce', 'handoff_nonce')
if held[1] ~= ARGV[1] or held[2] == ARGV[2] then
  return 0
end
-- What the decision admitted (as release.lua, unpublished), read before the first write: its
-- in-flight entry, and the window the entry names (as release.lua builds its key; KEYS[4]
-- for an older entry that names none), which gets it back only while it still holds it
-- (one gone past its retention is never made again here, with no TTL). That key is not in
-- KEYS: a cluster moving the slot may refuse it, and nothing is written before it is asked.
local entry = ARGV[5] == '1' and redis.call('HGET', KEYS[2], ARGV[4])
local window = false
if entry then
  local win = string.match(entry, '^[^|]+|(%d+)')
  window = win and string.match(KEYS[2], '^[^{]*{[^}]*}') .. ':window:' .. win or KEYS[4]
  window = redis.call('HGET', window, 'exposure') and window
end
-- A first write that frees memory (prev_nonce is written '' below): a Redis out of memory
-- lets a script go on once it has written, and refuses only a first write that may grow it.
redis.call('HDEL', KEYS[1], 'prev_nonce')
if ARGV[5] == '1' then
  redis.call('ZREM', KEYS[3], ARGV[4])
  if entry then
    redis.call('HDEL', KEYS[2], ARGV[4])
    redis.call('HSET', KEYS[1], 'reserved', redis.call('HGET', KEYS[1], 'charged') or '0')
    if window then
      redis.call('HINCRBYFLOAT', window, 'exposure', -tonumber(string.match(entry, '^[^|]+')))
    end
  end
  -- Taken back from admitted_free also when the entry went before (the sweep's purge check
  -- or gate.lua's horizon gave back the exposure as published): no message was published.
  if redis.call('HGET', KEYS[4], 'admitted_free') then  -- (not in a window made again)
    redis.call('HINCRBY', KEYS[4], 'admitted_free', -1)
  end
end
redis.call('HSET', KEYS[1], 'nonce', ARGV[2], 'decision', 'defer', 'prev_nonce', '', 'window', '')
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'free_admitted', ARGV[3])
end
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[1], 'abandoned', '1')
end
return 1
