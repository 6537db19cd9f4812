-- keep.lua: keep how the replayer (or `dead-letter requeue`) handed a deferred message on,
-- only while the attempt's record still holds the decision that made the handoff.
--
-- A copy leaves only once its handoff is kept (gatekeeper/redis/handoff.py). Kept after the
-- decision was replaced (a requeue of a twin of the message undid it, taking it for one cut
-- short; the record expired), the handoff would send a copy whose nonce the record no longer
-- holds: it is not kept, and the copy does not leave. The key before the nonce that points
-- to it: refused (out of memory, an ACL on the key), neither is written.
--
-- KEYS[1] handoff:<job_id>:<attempt>   string: the handoff (packed JSON)
-- KEYS[2] run:<job_id>:<attempt>       hash: the gate's record of the attempt
--
-- ARGV[1] the handoff, packed    ARGV[2] its TTL (s)    ARGV[3] the nonce of the message
-- handed on (the record's `handoff_nonce`)    ARGV[4] the decision's nonce
--
-- Returns 1 when kept; 0 when the record holds another nonce now, or none (nothing written).

local now = redis.call('HGET', KEYS[2], 'nonce')
if not now then
  return 0  -- no record (it expired): a key written now would outlive it
end
-- A write that changes nothing, first: where the keep must be refused, it is before anything
-- is written and whatever the nonce (a replica's READONLY after a failover, which the caller
-- takes as no answer and asks the new primary; a Redis out of memory).
redis.call('HSETNX', KEYS[2], 'nonce', now)
if now ~= ARGV[4] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[2], 'handoff_nonce', ARGV[3])
return 1
