-- take.lua: a worker is about to run a copy of a message the replayer (or a requeue, or the
-- expiry) published: is it the copy that runs?
--
-- On RabbitMQ the replayer acks a deferred message only once its rewritten copy is confirmed,
-- so a replayer that dies in between hands the same decision on twice (gatekeeper/redis/
-- handoff.py): two copies, one nonce, each with its own copy value (gatekeeper_copy). The
-- first copy to reach a worker takes the decision; the same copy again (the broker's own
-- redelivery, after its worker died) runs again, as start.lua counts it; any other copy is a
-- duplicate and does not run, redelivered or not. A message whose nonce is not the record's
-- is not the gate's: start.lua decides.
--
-- KEYS[1] run:<job_id>:<attempt>   the gate's record (field taken:<decision> = nonce|copy)
-- ARGV[1] nonce      the message's gatekeeper_nonce
-- ARGV[2] decision   the message's gatekeeper_decision (an expired free copy goes on to
--                    reserved with the same nonce: another decision, taken once of its own)
-- ARGV[3] copy       the message's gatekeeper_copy
--
-- Returns 'first', 'same' (the copy that took it, delivered again), 'again' (another copy of
-- a decision already taken, or a free copy of an admission withdrawn since: the replayer
-- expired it to reserved, whose copy runs) or 'not_ours'.

local field = 'taken:' .. ARGV[2]
local rec = redis.call('HMGET', KEYS[1], 'nonce', 'reason', field)  -- the record read once
if rec[1] ~= ARGV[1] then
  return 'not_ours'
end
local held = rec[3]
local mine = ARGV[1] .. '|' .. ARGV[3]
if held == mine then
  return 'same'  -- (an expired one again: its expiry republishes it, expire.lua 'again')
end
if held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then
  return 'again'
end
if ARGV[2] == 'admit_free' and rec[2] == 'free_wait_expired' then
  return 'again'  -- no free copy took it before the replayer withdrew it (expiry.py)
end
redis.call('HSET', KEYS[1], field, mine)
return 'first'
