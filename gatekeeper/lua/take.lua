-- take.lua: a worker is about to run a message the replayer handed on: is it the first copy?
--
-- On RabbitMQ the replayer acks a deferred message only once its rewritten copy is confirmed,
-- so a replayer that dies in between hands the same message on twice (the same nonce, the
-- same decision: gatekeeper/redis/handoff.py). The first copy to reach a worker takes the
-- attempt's decision; another copy that is not a redelivery is a duplicate and is not run.
-- (A redelivery, of a copy whose worker died, is the broker's own retry: start.lua handles
-- it.) A message whose nonce is not the record's is not the gate's: start.lua decides.
--
-- KEYS[1] run:<job_id>:<attempt>   the gate's record (field taken:<decision> = nonce)
-- ARGV[1] nonce      the message's gatekeeper_nonce
-- ARGV[2] decision   the message's gatekeeper_decision (an expired free copy goes on to
--                    reserved with the same nonce: another decision, taken once of its own)
--
-- Returns 'first', 'again' (a copy of this decision was taken before) or 'not_ours'.

if redis.call('HGET', KEYS[1], 'nonce') ~= ARGV[1] then
  return 'not_ours'
end
local field = 'taken:' .. ARGV[2]
local held = redis.call('HGET', KEYS[1], field)
if held == ARGV[1] then
  return 'again'
end
redis.call('HSET', KEYS[1], field, ARGV[1])
return 'first'
