-- move.lua: hand claimed messages on, atomically, on the broker's Redis.
--
-- The replayer claims messages by RPOPLPUSH from a defer list into its tenure's processing
-- list; this script removes each claimed copy and pushes its rewritten message onto its target
-- list, each in one step, so a replayer killed at any moment leaves every message in exactly
-- one place. A batch of the replayer's moves is one call.
--
-- It moves nothing once the tenure is over: its heartbeat is gone (deleted by a replayer that
-- found its lock lost, or expired with a stalled one), so what it claimed is the next holder's
-- to take back, whatever the replayer decided meanwhile.
--
-- KEYS[1]   processing list  <defer_queue>:replaying:<tenure> (the replayer's own); for a
--                            message read in place (the dead-letter commands), its own list
-- KEYS[2]   heartbeat        <defer_queue>:replayer:<tenure>: nothing moves unless it exists;
--                            for a message read in place, KEYS[1] again
-- KEYS[2+i] target list of message i: a kombu queue list (free, reserved, defer, dead_letter,
--                            or a priority sub-list "<queue>\x06\x16<n>")
-- ARGV[2i-1] message i, exactly as claimed
-- ARGV[2i]   message i to push (rewritten headers and delivery_info)
--
-- Returns one number per message: 1 when moved, 0 when its claimed copy was no longer there
-- or the tenure is over (nothing pushed for it). Refuses the whole call, moving nothing, when
-- a target key holds something other than a list: Redis does not undo a script's writes, so a
-- push that failed after its LREM would lose the message.

for i = 3, #KEYS do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind ~= 'list' and kind ~= 'none' then
    return redis.error_reply('WRONGTYPE move.lua: target ' .. KEYS[i] .. ' holds a ' .. kind ..
      ', not a list: nothing moved')
  end
end
local moved = {}
local live = redis.call('EXISTS', KEYS[2]) == 1
for i = 1, #KEYS - 2 do
  moved[i] = 0
  if live and redis.call('LREM', KEYS[1], 1, ARGV[2 * i - 1]) == 1 then
    redis.call('LPUSH', KEYS[2 + i], ARGV[2 * i])
    moved[i] = 1
  end
end
return moved
