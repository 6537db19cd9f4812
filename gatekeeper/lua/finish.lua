-- finish.lua: write the one ledger row of a run, charge its tax, release its exposure, and
-- count the run's time in its task's learned service time.
--
-- Idempotent per run: a signal that fires twice, or a retried write, finds `rowed` already
-- at this run and changes nothing. The row itself is built by the caller from the Python core
-- (gatekeeper/core/ledger.py make_row); this script applies it atomically.
--
-- Safe to send twice: each call carries a random token, kept in the record with what the call
-- that wrote the run's row replied (`rowed_by`). The same token again (a request re-sent
-- after a lost reply, the row written) gets that reply again, so the caller still logs the row
-- and its slack miss, once; another call for the run (a signal that fired twice) is told
-- nothing was written.
--
-- The ceiling (SPEC section 2): a free row is charged to the window that admitted it (the
-- budget that reserved it), never more, over all runs of the attempt, than the admission
-- reserved (the record's `reserved`; `charged` sums what its rows were charged). A row whose
-- tax would pass that is written with the tax it was charged. The exposure an attempt holds
-- goes with its rows: a dead run's row (`current` 0: its redelivered copy is running) takes
-- only its own tax out; the latest run's row the rest, and closes the reservation.
--
-- Learned service times (SPEC section 6): when the caller says the run counts (ARGV[12] is
-- its bucket's field, chosen by gatekeeper/core/service.py bucket_of), the row's write adds
-- one to that bucket in the same step, so a run is counted once, only with its row, and a
-- worker's run costs no round trip of its own for it.
--
-- After the row of the attempt's latest run (every run it has had now has its row) the record
-- is cut to what a later run of the attempt and the one-row-per-attempt rule read
-- (gatekeeper/redis/kept.py): nonce, decision, reason, runs, rowed, rowed_by, free_admitted
-- (when 1), missed and free_window, the replayer's fields, and `kept` = '<published_ms>|
-- <deadline_ms>|<tokens_in>|<window>' for the row of a redelivery; the reservation is closed
-- (`kept` present: nothing more to charge). The fields a redelivered run's start writes again
-- are dropped (four of the worker's own numbers are one, `own`; a record an older worker
-- started, or one whose `own` would be too long for a compact hash, keeps those four laid
-- out).
--
-- KEYS[1] run:<job_id>:<attempt>   hash: rowed = the last run that has its row; rowed_by =
--                                  '<token>|<missed>[|<tax as written, when capped>]' of the
--                                  call that wrote it; reserved, charged, kept
-- KEYS[2] window:<row window>       hash: rows:<outcome> (a reserved row)
-- KEYS[3] window:<row window>:rows  list: ledger rows (JSON): a reserved row's
-- KEYS[4] inflight                  hash: <job_id>:<attempt> -> "<reserved>|<window>|<ms>|..."
-- KEYS[5] started                   sorted set: runs started without a row
-- KEYS[6] window:<admission window> hash: admitted_free, slack_misses; and a free row's
--                                   tax_units, rows:<outcome>, killed_free. For an attempt
--                                   not admitted itself, its job's admission's window (a
--                                   miss: gatekeeper/redis/owner.py), else the row's. The
--                                   exposure goes back to the window the `inflight` entry
--                                   names (its key built from KEYS[4]'s prefix, up to the
--                                   hash tag: one cluster slot), KEYS[6] for an entry that
--                                   names none, and only while that window holds one
-- KEYS[7] window:<admission window>:rows  list: a free row's
-- KEYS[8] totals                    hash: lifetime killed_rows, slack_misses (never expire)
-- KEYS[9] decisions                 stream: the decision records; a slack miss adds an entry
--                                   `miss` = member (unless ARGV[11] is 0)
-- KEYS[10] service:times:<task>     hash: b<bucket> -> runs, lower_bounds (no TTL)
-- KEYS[11] service:names            set: the tasks that have a service:times hash (no TTL)
-- KEYS[12] run:<job_id>:<admitting attempt>  the record of the free admission a miss of this
--                                   run belongs to (KEYS[1] when none is known): `missed`
--
-- ARGV[1] member        <job_id>:<attempt>
-- ARGV[2] run           the run this row belongs to
-- ARGV[3] row           JSON
-- ARGV[4] outcome       ok | killed | expired
-- ARGV[5] path          free | reserved
-- ARGV[6] retry_tax     this row's tax (charged to tax_units on the free path only)
-- ARGV[7] slack_miss    1 when a free-admitted job ended (ok, or failed for good) after its
--                       deadline; 'e' when the job ended here in time (failed for good); 'r'
--                       when it goes on in its next attempt (a retry); 0 when it goes on in
--                       this one (a requeued or vanished run) or is ok
-- ARGV[8] retention_s   TTL of the window's keys
-- ARGV[9] current       1 when this run is the attempt's latest start (it leaves `started`)
-- ARGV[10] row head     the row's JSON without its last field (retry_tax) and closing brace
-- ARGV[11] record_cap    how many decision records to keep (about); '0': none
-- ARGV[12] bucket        the run's service-time bucket field (`b<i>`); '': the run does not
--                        count (not ok and not cut by its time limit, or not this app's task)
-- ARGV[13] lower_bound   1 when the run was killed by its time limit (it ran at least that)
-- ARGV[14] task          the task's name, for service:names
-- ARGV[15] long          1 when the run's task or worker is longer than a compact hash's
--                        values, or it is not the attempt's first run (the cut then writes
--                        the record again: below)
-- ARGV[16] token         this call's random value (the same when it is sent again)
-- ARGV[17] nonce         the run's message's nonce ('' or none: not checked): a record that
--                        holds another (the task id published again after this run's row,
--                        then this call sent again) is not this run's, and is left alone
--
-- Returns {written (0|1), admission window's slack_misses, admission window's admitted_free,
-- the row's retry_tax as written (a free row's capped by its reservation), missed (1 when
-- the slack miss was counted: not for a rerun after the row that ended the job)}; {0, 0, 0, '0'}
-- when the run had its row already, but for the call that wrote it, sent again: its reply
-- (the window's counts as they are now).

local function fmt17(x) return string.format('%.17g', x) end
-- Whole numbers go to redis.call as the text they came in ('1', ARGV[8]): the server formats
-- a Lua number with snprintf on every call (bench/worker_ir.py counted it). HINCRBYFLOAT
-- keeps its numbers: it reads text as a long double, and fmt17's text of a sum would differ.

local run = tonumber(ARGV[2])
-- The record read once: what this row needs, and what a cut keeps (below).
local rec = redis.call('HMGET', KEYS[1], 'rowed', 'runs', 'reserved', 'charged', 'kept',
  'published_ms', 'deadline_ms', 'tokens_in', 'window', 'free_admitted', 'prev_nonce', 'nonce',
  'owed')
if ARGV[17] and ARGV[17] ~= '' and rec[12] and rec[12] ~= ARGV[17] then
  return {0, 0, 0, '0'}  -- another life of the attempt (gate.lua counts its runs anew)
end
-- `rowed` is the last run with its row. A row that passes over earlier runs still without
-- theirs (a dead run's row kept by its worker while Redis was silent, overtaken by the
-- redelivered run's own) leaves them `owed`, ',<run>,', so that each still gets its one row
-- when it comes: late, `rowed` stays, and its entry becomes ',<run>=<its reply>,'. The row of
-- a run that is not the attempt's latest start is a dead run's whatever its caller says (a
-- worker sends its own run as current, and a kept row may come after a later run started):
-- the latest run may still be going. gate.lua, record.lua and fallback.lua drop `owed` with
-- `runs` and `rowed` when the attempt starts again.
local mark = tonumber(rec[1] or '0')
local owed = rec[13] or ','
local late = mark >= run and string.find(owed, ',' .. ARGV[2] .. ',', 1, true)
local current = ARGV[9] == '1' and not late and not (rec[2] and tonumber(rec[2]) > run)
if mark >= run and not late then
  -- The run has its row: nothing is written, and a duplicate is told so; the call that wrote
  -- it, sent again after its reply was lost, gets that reply (`rowed_by` is read here alone:
  -- a walk of the record a first call need not pay; a late row's, in `owed`).
  local by = mark == run and redis.call('HGET', KEYS[1], 'rowed_by')
    or string.match(owed, ',' .. ARGV[2] .. '=([^,]*)') or ''
  local token, missed, tax = string.match(by, '^([^|]*)|(%d)|?(.*)$')
  if token ~= ARGV[16] then
    return {0, 0, 0, '0'}
  end
  local counts = redis.call('HMGET', KEYS[6], 'slack_misses', 'admitted_free')  -- (as below)
  return {1, tonumber(counts[1] or '0'), tonumber(counts[2] or '0'),
    tax ~= '' and tax or ARGV[6], tonumber(missed)}
end
-- Read before this call's first write: the admission window's counts (the reply's, below,
-- with this row's miss added), the attempt's in-flight entry (what its admission holds),
-- read once, and whether the window the entry names still holds an exposure (KEYS[6] for an
-- older entry that names none; another's key built as release.lua builds it: not in KEYS, so
-- a cluster moving the slot may refuse it, and nothing is written before it is asked). Only
-- then is the exposure given back there: a window gone past its retention took it along (a
-- free row makes it again, with the row's TTL; a reserved row's give-back, with none).
local counts = redis.call('HMGET', KEYS[6], 'slack_misses', 'admitted_free', 'exposure')
local entry = redis.call('HGET', KEYS[4], ARGV[1])
local exposed = false
if entry then
  local win = string.match(entry, '^[^|]+|(%d+)')
  local named = win and ':window:' .. win
  if not named or string.sub(KEYS[6], -#named) == named then
    exposed = counts[3] and KEYS[6]
  else
    exposed = string.match(KEYS[4], '^[^{]*{[^}]*}') .. named
    exposed = redis.call('HGET', exposed, 'exposure') and exposed
  end
end
-- A rerun after the row that ended the attempt's job (`ok`, or failed for good: `kept` ends
-- in '|ok' or '|end'; a lost ack, a redelivery): the job finished then, and its slack was
-- judged at that row. A late rerun is no miss of it. Nor is a run after a retry's row
-- ('|on<run>': the job went on in its next attempt). But a late row (`owed`) of a run started
-- before the retry's is judged as it would have been had it come first: its job's end, when
-- it is one, still counts. (A publish of the attempt after the cut writes published_ms
-- anew: its runs are judged.)
local function ended(kept, earlier)
  local retried = string.match(kept, '|on(%d+)$')
  if retried then return not earlier or run > tonumber(retried) end
  return string.sub(kept, -3) == '|ok' or string.sub(kept, -4) == '|end'
end
local rerun = rec[5] and not rec[6] and ended(rec[5], late)
local missed = ARGV[7] == '1' and not rerun
-- One miss per free admission (gatekeeper/redis/owner.py): the admission's record (KEYS[12],
-- this one or an earlier attempt's) keeps `missed`, the member that counted it, so another
-- end of its job (a retry published with throw=False beside an ok end) counts none.
if missed and redis.call('EXISTS', KEYS[12]) == 1
    and redis.call('HSETNX', KEYS[12], 'missed', ARGV[1]) == 0 then
  missed = false
end
-- The attempt's last run: no run of it is left without its row, so the record is cut below
-- (what `charged` and `reserved` would say after this row, `kept` says: closed).
local cut = rec[2] ~= false and tonumber(rec[2]) == run
local free = ARGV[5] == 'free'
local window, rows, row = KEYS[2], KEYS[3], ARGV[3]
local written_tax = ARGV[6]
if free then
  window, rows = KEYS[6], KEYS[7]
  local tax = tonumber(ARGV[6])
  local held = {rec[3], rec[4]}
  if rec[5] and not held[1] then held[1] = '0' end  -- cut after an earlier row: closed
  if held[1] then  -- a record written before reservations has no cap to apply
    local left = math.max(0, tonumber(held[1]) - tonumber(held[2] or '0'))
    if tax > left then
      tax = left
      written_tax = fmt17(tax)
      row = ARGV[10] .. ', "retry_tax": ' .. written_tax .. '}'
    end
  end
  local charged = '0'
  if not cut and not (late and not rec[3]) then  -- (late after the cut: closed, nothing)
    charged = redis.call('HINCRBYFLOAT', KEYS[1], 'charged', tax)
  end
  redis.call('HINCRBYFLOAT', window, 'tax_units', tax)
  if ARGV[4] == 'killed' then
    redis.call('HINCRBY', window, 'killed_free', '1')
  end
  if not current and held[1] then
    -- A dead run's row, written when the redelivered copy starts: only its tax leaves the
    -- exposure; the rest stays reserved for the run that is going on.
    if entry then
      local amount, rest = string.match(entry, '^([^|]+)(.*)$')
      local left = tonumber(amount) - tax
      if left > 0 then
        redis.call('HSET', KEYS[4], ARGV[1], fmt17(left) .. rest)
      else
        redis.call('HDEL', KEYS[4], ARGV[1])
      end
      if exposed then
        redis.call('HINCRBYFLOAT', exposed, 'exposure', -math.min(tax, tonumber(amount)))
      end
    end
  elseif held[1] and not cut then
    -- The attempt's latest run has its row: the reservation closes (what was not charged
    -- goes back below), so a later run of it (a redelivery) is charged nothing.
    redis.call('HSET', KEYS[1], 'reserved', charged)
  end
end
-- Written once the tax is known: the run has its row, and what this call replies (above).
local reply = ARGV[16] .. '|' .. (missed and '1' or '0')
  .. (written_tax ~= ARGV[6] and '|' .. written_tax or '')
-- What `kept` ends with once the job's end has its row: '|ok', or '|end' (failed for good);
-- '|on<run>' once the job went on in its next attempt (this run's retry).
local ending = ARGV[4] == 'ok' and '|ok' or (ARGV[7] == 'r' and '|on' .. ARGV[2])
  or (ARGV[7] ~= '0' and '|end' or '')
if late then  -- its entry ',<run>,' becomes ',<run>=<reply>,' (no ',' in a reply)
  redis.call('HSET', KEYS[1], 'owed', string.sub(owed, 1, late) .. ARGV[2] .. '=' .. reply
    .. string.sub(owed, late + 1 + #ARGV[2]))
  if ending ~= '' and rec[5] and not rec[6] and not ended(rec[5]) then
    redis.call('HSET', KEYS[1], 'kept', rec[5] .. ending)  -- the job ended at this run, as
  end  -- the cut would say had this row come first: a rerun after it is no slack miss
else
  if run > mark + 1 then  -- the runs passed over, the nearest 16 (a run is a start: few)
    for r = math.max(mark + 1, run - 16), run - 1 do owed = owed .. r .. ',' end
    redis.call('HSET', KEYS[1], 'owed', owed)
  end
  redis.call('HSET', KEYS[1], 'rowed', ARGV[2], 'rowed_by', reply)
end
redis.call('RPUSH', rows, row)
redis.call('EXPIRE', rows, ARGV[8])
redis.call('HINCRBY', window, 'rows:' .. ARGV[4], '1')
redis.call('EXPIRE', window, ARGV[8])
if ARGV[4] == 'killed' then
  redis.call('HINCRBY', KEYS[8], 'killed_rows', '1')
end
if redis.call('TTL', KEYS[1]) == -1 then  -- a record that expired mid-run, written anew
  redis.call('EXPIRE', KEYS[1], ARGV[8])
end
-- (The entry as read above: only a dead run's free row, never this branch, changes it.)
if entry and (current or (ARGV[5] ~= 'free' and not late)) then
  redis.call('HDEL', KEYS[4], ARGV[1])
  if exposed then
    redis.call('HINCRBYFLOAT', exposed, 'exposure', -tonumber(string.match(entry, '^[^|]+')))
  end
end
if missed then
  redis.call('HINCRBY', KEYS[6], 'slack_misses', '1')
  redis.call('EXPIRE', KEYS[6], ARGV[8])
  redis.call('HINCRBY', KEYS[8], 'slack_misses', '1')
  if tonumber(ARGV[11]) > 0 then  -- best effort, as in gate.lua
    local kept = redis.pcall('XADD', KEYS[9], 'MAXLEN', '~', ARGV[11], '*', 'miss', ARGV[1])
    if type(kept) == 'table' and kept.err then
      redis.call('HINCRBY', KEYS[8], 'records_refused', '1')
    end
  end
end
if current then
  redis.call('ZREM', KEYS[5], ARGV[1])
end
if ARGV[12] ~= '' then
  redis.call('HINCRBY', KEYS[10], ARGV[12], '1')
  if ARGV[13] == '1' then
    redis.call('HINCRBY', KEYS[10], 'lower_bounds', '1')
  end
  redis.call('SADD', KEYS[11], ARGV[14])
end
if cut then
  local gone = {'published_ms', 'deadline_ms', 'tokens_in', 'window', 'admitted_ms', 'dwell_s',
    'label', 'reserved', 'charged', 'expired_ms', 'started_ms', 'start_token', 'start_dead',
    'task', 'own', 'worker'}
  if rec[10] ~= '1' then gone[#gone + 1] = 'free_admitted' end
  if rec[11] == '' then gone[#gone + 1] = 'prev_nonce' end
  if rec[6] or not rec[5] then  -- (a publish of the attempt after a cut writes its fields anew)
    redis.call('HSET', KEYS[1], 'kept', (rec[6] or '') .. '|' .. (rec[7] or '') .. '|'
      .. (rec[8] or '') .. '|' .. (rec[9] or '') .. ending)
  elseif ending ~= '' and not ended(rec[5]) then  -- the job's end after a killed row's cut
    redis.call('HSET', KEYS[1], 'kept', rec[5] .. ending)
  end
  redis.call('HDEL', KEYS[1], unpack(gone))
  -- A value longer than a compact hash holds (`hash-max-ziplist-value`, 64 bytes by default:
  -- a long task name, the label the gate wrote of it, or worker) made the record a hash table,
  -- and HDEL leaves it one, about four times a compact record's memory for the rest of its
  -- retention (bench/memory.py). When the caller says so (ARGV[15]), it is written again,
  -- under the TTL it had, and is compact, unless what stays is itself too long (an older
  -- replayer's handoff) or too many fields (past `hash-max-ziplist-entries`, 128: a flood of
  -- duplicate publishes' dup:*; unpack has a limit of its own too): then it is left as it
  -- is. (Asking the server, OBJECT ENCODING, would cost every cut 3% of its instructions and a
  -- command an ACL must grant.)
  if ARGV[15] == '1' then
    -- The TTL read first: a record in its last millisecond (PTTL 0) is left to expire, never
    -- written again without one.
    local ttl = redis.call('PTTL', KEYS[1])
    local stay = ttl > 0 and redis.call('HGETALL', KEYS[1]) or {}
    local short = #stay > 0 and #stay <= 256
    for i = 1, short and #stay or 0 do
      if #stay[i] > 64 then short = false break end
    end
    -- A cluster node moving the slot away (MIGRATING) refuses a command on a key it does not
    -- hold, and the record is one once deleted: the script would fail between the DEL and
    -- the HSET, after the row's writes (a reviewer). Such a node refuses a key of the slot
    -- that never exists too: asked first, it leaves the record as it is (a hash table).
    if short and type(redis.pcall('EXISTS', string.match(KEYS[1], '^[^{]*{[^}]*}')
        .. ':never')) == 'table' then
      short = false
    end
    if short then
      redis.call('DEL', KEYS[1])
      redis.call('HSET', KEYS[1], unpack(stay))
      redis.call('PEXPIRE', KEYS[1], ttl)
    end
  end
end
return {1, tonumber(counts[1] or '0') + (missed and 1 or 0), tonumber(counts[2] or '0'),
  written_tax, missed and 1 or 0}
