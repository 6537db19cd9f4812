-- unscore.lua: undo the replayer's decision of a deferred message that was never handed on.
--
-- The replayer scored the message (gate.lua or record.lua wrote a new nonce into the record,
-- and the message's as its prev_nonce), then no copy left: its handoff was not kept (refused,
-- or its pass killed or stopped before it). What the decision admitted is given back first
-- (release.lua); this script makes the record the message's again, as parked: its nonce, the
-- decision `defer`, no prev_nonce and no admission window. The message, still carrying its
-- nonce, is then the record's deferred message for every later pass, also when it comes back
-- unmoved from a pass that stops before its next handoff (handoff.as_scored).
--
-- KEYS[1] run:<job_id>:<attempt>   hash: the gate's record of the attempt
--
-- ARGV[1] the decision's nonce (the record's now)   ARGV[2] the message's nonce
-- ARGV[3] free_admitted to write ('': left as it is)
--
-- Returns 1 when undone; 0 when the record holds another nonce now (left alone).

if redis.call('HGET', KEYS[1], 'nonce') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'nonce', ARGV[2], 'decision', 'defer', 'prev_nonce', '', 'window', '')
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'free_admitted', ARGV[3])
end
return 1
