-- forget.lua: deferred attempts whose messages left defer for good (handed on, dead-lettered):
-- their deadlines no longer count (gatekeeper/redis/snapshot.py forget_deferred).
--
-- KEYS[1] deferred   sorted set: <job_id>:<attempt> -> deadline (ms), written by gate.lua
--
-- ARGV    member, deadline pairs: a member goes only while its score is that message's
--         deadline (ms), so that a copy of an earlier life of the attempt (dead-lettered)
--         leaves alone a later publish of it deferred meanwhile; '' (no deadline the
--         message can say): it goes whatever its score.
--
-- Returns how many members went.

local gone = 0
for i = 1, #ARGV, 2 do
  -- The member's score, unchanged (false when absent): ZADD XX INCR 0, as the README's ACL
  -- for the gate's user allows ZADD and not ZSCORE.
  local score = redis.call('ZADD', KEYS[1], 'XX', 'INCR', '0', ARGV[i])
  if score and (ARGV[i + 1] == '' or math.abs(tonumber(score) - tonumber(ARGV[i + 1])) < 1) then
    gone = gone + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return gone
