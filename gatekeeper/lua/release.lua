-- release.lua: give back the exposure of an admitted free attempt that will never run here.
--
-- For an attempt whose publish failed after the gate admitted it, one revoked or expired
-- before it started, or one the sweep finds admitted long ago and never started. No row:
-- the attempt did not run. Idempotent: the second call finds nothing to release.
--
-- KEYS[1] inflight                  hash: <job_id>:<attempt> -> "<reserved>|<window>|<ms>|..."
-- KEYS[2] free:waiting              sorted set: admitted free attempts not yet started
-- KEYS[3] window:<admission window> hash: exposure, admitted_free; the caller's view of the
--                                   window: the `inflight` entry's own window is the one
--                                   released (its key built from KEYS[1]'s prefix, up to the
--                                   hash tag, as gate.lua builds it: one cluster slot), KEYS[3]
--                                   only for an entry that names none (an older version's)
-- KEYS[4] run:<job_id>:<attempt>    the gate's record: its `reserved` closes (= `charged`): a
--                                   run that starts after all (a message taken for purged
--                                   that was not) is charged nothing it no longer reserves
--
-- ARGV[1] member       <job_id>:<attempt>
-- ARGV[2] unpublished  "1" when the message was never published (the broker refused it, or
--                      Celery failed to build it): the admission itself is taken back from
--                      admitted_free, so the freeze rule's miss rate is not diluted by it
--
-- Returns what was released (0 when the attempt held nothing).

local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
local amount, win = string.match(held, '^([^|]+)|?([^|]*)')
local tokens = tonumber(amount)
local window = KEYS[3]
if win and string.match(win, '^%d+$') then
  window = string.match(KEYS[1], '^[^{]*{[^}]*}') .. ':window:' .. win
end
-- A window gone past its retention took its exposure along: only one that still holds it
-- (`exposure`, which gate.lua writes with every admission; a window made again by a late
-- row has none) gets it back. Never written otherwise (a hash made here would have no TTL).
-- Asked before the first write: the key is not in KEYS, which a cluster moving the slot may
-- refuse, and then nothing is written.
local holds = redis.call('HGET', window, 'exposure')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then  -- closed: nothing more to charge
  redis.call('HSET', KEYS[4], 'reserved', redis.call('HGET', KEYS[4], 'charged') or '0')
end
if holds then
  redis.call('HINCRBYFLOAT', window, 'exposure', -tokens)
  if ARGV[2] == '1' then
    redis.call('HINCRBY', window, 'admitted_free', -1)
  end
end
return tokens
