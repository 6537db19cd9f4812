-- move.lua: hand a claimed message on, atomically, on the broker's Redis.
--
-- The replayer claims a message by RPOPLPUSH from a defer list into its processing list; this
-- script removes that copy and pushes the rewritten message onto its target list in one step,
-- so a replayer killed at any moment leaves the message in exactly one place.
--
-- KEYS[1] processing list   <defer_queue>:replaying:<tenure> (the replayer's own)
-- KEYS[2] target list       a kombu queue list (free, reserved, defer, dead_letter, or a
--                           priority sub-list "<queue>\x06\x16<n>")
-- ARGV[1] the claimed message, exactly as claimed
-- ARGV[2] the message to push (rewritten headers and delivery_info)
--
-- Returns 1 when moved, 0 when the claimed copy was no longer there (nothing pushed).

if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[2])
  return 1
end
return 0
