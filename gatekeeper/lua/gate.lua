-- gate.lua: one publish-time decision for a gated attempt, in one atomic step.
--
-- Repeats the dwell gate's rules 2-4 (gatekeeper/dwell.py) and the admission inequality
-- (gatekeeper/ledger.py) so that reading the free queue's age, checking the budget and
-- reserving the attempt's exposure cannot interleave with another publisher's.
-- tests/test_gate_script.py holds this script and the Python core to the same answers.
--
-- KEYS[1] free:waiting      sorted set: member <job_id>:<attempt>, score = when it is due (ms),
--                           and the pad (score +inf; the admission's ZADD below)
-- KEYS[2] window:<id>       hash: tax_units, exposure, admitted_free, rejected,
--                           decided:<decision>:<reason> (not for admissions: admitted_free
--                           counts those), review:defer_fit, review:reserved_age_shift,
--                           free_age_max_ms (the oldest free-queue age a decision saw)
-- KEYS[3] window:<id>:rows  list: ledger rows (JSON), oldest first
-- KEYS[4] inflight          hash: <job_id>:<attempt> -> "<reserved>|<window id>|<admitted ms>|
--                           <WIDE>" (WIDE below: readers take the first three fields)
-- KEYS[5] flags             hash: live flag overrides (free_path_enabled read here, so a
--                           freeze in Redis holds for every publisher at once, cache or not)
--                           and the state marker initialised_at: without it (a Redis that
--                           lost its data) nothing is admitted (state_missing)
-- KEYS[6] run:<job_id>:<attempt>    hash: the gate's record of this attempt (what its ledger
--                           row needs, written here; the worker trusts a message only when it
--                           carries the record's nonce). A re-sent (ARGV[23]) or fast
--                           request that finds its own nonce here was already decided: it
--                           changes nothing and pushes nothing
-- KEYS[7] run:<job_id>:<attempt-1>  the previous attempt's record (KEYS[6] again for attempt
--                           1): its free_admitted carries over
-- KEYS[8] totals            hash: lifetime counters (never expire), decided:<decision>:
--                           <reason>:<task> here (gatekeeper metrics exports them), and
--                           records_refused (decision records that could not be written)
-- KEYS[9] deferred          sorted set: deferred attempts, score = deadline (ms), the
--                           DEFERRED_CAP (ARGV[27]) nearest kept
-- KEYS[10] decisions         stream: the decision records (gatekeeper/core/whatif.py FIELDS),
--                           about ARGV[29] entries kept
-- KEYS[11..13]              (fast publish only) the broker lists of the free, defer and
--                           reserved queues: kombu's list names, on this same server
--
-- ARGV[1]  now_ms            the caller's clock (scripts never read the time)
-- ARGV[2]  member            <job_id>:<attempt>
-- ARGV[3]  expected_service_s
-- ARGV[4]  retry_tax_s
-- ARGV[5]  deadline_slack_s
-- ARGV[6]  max_queue_age_s
-- ARGV[7]  tokens_in
-- ARGV[8]  budget_units
-- ARGV[9]  queue_wait_unit_per_second
-- ARGV[10] budget_mode       "exposure" or "optimistic"
-- ARGV[11] horizon_ms        waiting members older than this are dropped
-- ARGV[12] retention_s       TTL of the window's keys
-- ARGV[13] job_id            for the rejected row
-- ARGV[14] attempt
-- ARGV[15] deadline_slack_ms
-- ARGV[16] delay_s           seconds until a delayed (ETA/countdown) task is due; 0 if not
-- ARGV[17] window_id         this window's id, kept with the attempt's exposure
-- ARGV[18] nonce             this publish request's random value (the message carries it)
-- ARGV[19] published_ms      this attempt's first publish (its queue wait starts there)
-- ARGV[20] record_ttl_s      TTL of the record
-- ARGV[21] deadline_ms       the attempt's deadline (for the record)
-- ARGV[22] admitted_ms       when a free wait would start: now, or when a delayed task is due
-- ARGV[23] rerun             '1' when this request may have run already (sent through a
--                            client that retries): its nonce is looked up first, as it
--                            always is for fast publish (a stalled script must not push a
--                            message that fallback.lua pushed meanwhile)
-- ARGV[24] prev_nonce        the nonce the message already carries for this attempt (a
--                            replay of a deferred attempt), '' for a first publish; kept in
--                            the record, so that a replayer killed before it handed the
--                            message on finds the message it scored still the gate's
-- ARGV[25] allowance_units  the wait an admission reserves, in units (free_wait_allowance_s x
--                            queue_wait_unit_per_second; not in optimistic mode's budget
--                            check): with its tokens, the most the attempt can be charged
--                            (SPEC's ceiling; the record's `reserved`, in either mode)
-- ARGV[26] task             the task's label for the totals (a registered gated task's
--                            name, else 'other'), kept in the record for its replays
-- ARGV[27] deferred_cap      how many members `deferred` keeps
-- ARGV[28] publisher         the record's `p` field: what the publisher knew and the script
--                            does not ('<declared>|<learned p95>|<samples>|<retries left>|
--                            <wait allowance s>')
-- ARGV[29] record_cap        how many decision records to keep (about); '0': none
-- ARGV[30..32]              (fast publish only) the free, defer and reserved queue names
-- ARGV[33..]                (fast publish only) the kombu message, JSON, cut at the values
--                            the decision decides: text, name, text, name, ..., text
--                            (gatekeeper/redis/push.py); the names are decision, reason,
--                            dwell, free, window and queue
--
-- Fast publish: when the broker is this Redis, the decided message is pushed here, in the
-- same step, so a gated publish costs the one round trip a plain publish costs.
--
-- A refused attempt appends its `rejected` row (the same JSON as LedgerRow.to_json(): no
-- tokens, no wait charge), built here so that admissions pay nothing for it.
--
-- Returns {decision, reason, queue_age_s, dwell_s, projected_tax, free_admitted}, numbers as
-- strings (Redis would truncate a Lua float reply to an integer); dwell_s as '%.6f' (the
-- text the message carries), 'nan' when unknown.

local function finite(x)
  return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge
end

-- Server time: besides the commands themselves, each redis.call and each of its arguments
-- costs, and so does every conversion between text and number (a number handed to
-- redis.call is written with '%.17g'; tostring, string.format and tonumber take half a
-- microsecond to a microsecond each on the VM of bench/README.md). So arguments pass through
-- as the text they came in (ARGV, or a literal '1'), a value is written once and reused, a
-- zero is written as '0' without a format, and the window is read once (bench/gate_script.py
-- measures each path).
-- tostring writes 14 significant digits: a millisecond timestamp or a dwell in seconds keeps
-- its precision, and it costs a fraction of string.format('%.17g') here.
local fmt = tostring

local now = tonumber(ARGV[1])
local service = tonumber(ARGV[3])
local tax = tonumber(ARGV[4])
local slack = tonumber(ARGV[5])
local cap = tonumber(ARGV[6])
local delay = ARGV[16] == '0' and 0 or tonumber(ARGV[16])  -- most tasks are not delayed
local fast = #ARGV >= 33
local seen  -- the window's tax_units, exposure and free_age_max_ms, once read
local held = redis.call('HMGET', KEYS[6], 'nonce', 'decision', 'reason', 'free_admitted',
  'runs', 'rowed', 'dup:' .. ARGV[18], 'abandoned')
if held[1] == ARGV[18] then
  -- This very request was already decided (a re-sent call, or fallback.lua pushed its
  -- message first): say so, change nothing.
  return {held[2], held[3], '0', 'nan', '0', held[4] or '0'}
end
if held[7] then  -- this request was decided as a duplicate already (dup:<nonce> below)
  local decision, reason = string.match(held[7], '^([^|]*)|(.*)$')
  return {decision, reason, '0', 'nan', '0', '0'}
end
-- Another publish of this attempt holds a live record (not yet run to its row): a second
-- publish of the same task id and attempt must not orphan it, so it goes to reserved with
-- no record of its own (its run is priced nothing; the live record keeps dup:<nonce> so that
-- this request is never pushed twice). A replay presents the record's nonce. An attempt
-- abandoned in defer (abandon.lua) has its row, as one run to its row has.
local duplicate = false
if held[1] and held[1] ~= ARGV[24] and not held[8] then
  local runs, rowed = tonumber(held[5] or '0'), tonumber(held[6] or '0')
  duplicate = runs == 0 or rowed < runs
end
local carried = '0'
if KEYS[7] ~= KEYS[6] and redis.call('HGET', KEYS[7], 'free_admitted') == '1' then
  carried = '1'
end

local age = 0
local oldest = redis.call('ZRANGE', KEYS[1], '0', '0', 'WITHSCORES')
local unpadded = oldest[1] == nil  -- no member, not even the pad (see the ZADD at the end)
local due = oldest[2] and tonumber(oldest[2])
if due and due < now - tonumber(ARGV[11]) then
  -- Admissions past the horizon (a purged or lost message, never started) stop counting at
  -- once; up to 16 of them per call are also dropped and give back what they
  -- reserved, so that without a sweep `waiting` and `inflight` stay bounded. Their window
  -- and record keys are built here from KEYS[6]'s prefix, `<prefix>:{<namespace>}` up to its
  -- hash tag (neither holds a brace; a task id, chosen by the caller, may hold ':run:'), so
  -- they share its cluster slot.
  local cutoff = '(' .. fmt(now - tonumber(ARGV[11]))
  local base = string.match(KEYS[6], '^[^{]*{[^}]*}')
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff, 'LIMIT', 0, 16)) do
    redis.call('ZREM', KEYS[1], member)
    local stale = redis.call('HGET', KEYS[4], member)
    if stale then
      redis.call('HDEL', KEYS[4], member)
      -- (An entry of an older version may name no window: there is none to give back to.)
      local amount, win = string.match(stale, '^([^|]+)|?([^|]*)')
      local window = base .. ':window:' .. win
      if win ~= '' and redis.call('HGET', window, 'exposure') then  -- (as release.lua)
        redis.call('HINCRBYFLOAT', window, 'exposure', -tonumber(amount))
      end
      local record = base .. ':run:' .. member
      if redis.call('EXISTS', record) == 1 then redis.call('HSET', record, 'reserved', '0') end
    end
  end
  oldest = redis.call('ZRANGEBYSCORE', KEYS[1], string.sub(cutoff, 2), '+inf', 'WITHSCORES',
    'LIMIT', 0, 1)
  due = oldest[2] and tonumber(oldest[2])
end
if due then
  age = math.max(0, now - due) / 1000
end

local reserved = '0'  -- what an admission holds in exposure, as text (set before admitting)
local capped = '0'  -- the most its rows may be charged, the record's `reserved` (the same, but
-- in optimistic mode, whose budget check holds the tokens alone: the allowance's wait too)
-- Past Redis's hash-max-ziplist-value (hash-max-listpack-value on Redis 7; 64 bytes by
-- default) a hash leaves its compact encoding, which is searched field by field, for a hash
-- table. WIDE ends every in-flight value and is the `hash_table` field of windows and totals
-- (below), so that each is a hash table from its first writes: with 300-500 jobs in flight,
-- HSETNX on a compact `inflight` took a third of an admission's instructions (415 thousand
-- against 270: bench/gate_ir.py). 65 zeros: a reader that sums a hash's fields reads 0. About
-- 66 bytes more per attempt in flight, none once it has ended (its field goes).
local WIDE = '00000000000000000000000000000000000000000000000000000000000000000'

-- Decided: the writes every decision makes, and the reply. dwell is nil when unknown (NaN);
-- projected is the reply's text.
local function decided(decision, reason, dwell, projected)
  local admitted = decision == 'admit_free'
  local free = (admitted or carried == '1') and '1' or '0'
  local shown = 'nan'
  if finite(dwell) then shown = string.format('%.6f', dwell) end
  if fast then
    -- The decided message, its cut pieces joined with the decided values (names need no
    -- escaping: queue names come from settings).
    local index = admitted and 0 or (decision == 'defer' and 1 or 2)
    local out = {}
    for i = 33, #ARGV, 2 do
      out[#out + 1] = ARGV[i]
      local name = ARGV[i + 1]
      if name == nil then break
      elseif name == 'decision' then out[#out + 1] = '"' .. decision .. '"'
      elseif name == 'reason' then out[#out + 1] = '"' .. reason .. '"'
      elseif name == 'dwell' then out[#out + 1] = shown == 'nan' and 'null' or shown
      elseif name == 'free' then out[#out + 1] = free == '1' and 'true' or 'false'
      elseif name == 'window' then out[#out + 1] = admitted and ARGV[17] or 'null'
      elseif name == 'queue' then out[#out + 1] = '"' .. ARGV[30 + index] .. '"'
      end
    end
    redis.call('LPUSH', KEYS[11 + index], table.concat(out))
  end
  -- The gate's record: what the attempt's ledger row needs, and the nonce that proves a
  -- message is the one decided here.
  if duplicate then  -- remembered in the live record, for a re-sent request or fallback.lua
    redis.call('HSET', KEYS[6], 'dup:' .. ARGV[18], decision .. '|' .. reason)
  else
    if (held[5] or held[6]) and held[1] ~= ARGV[24] then
      -- A publish after the attempt's row (a reused task id, or a record Redis lost of which
      -- a late row left its marks) starts it again: its runs are counted anew, so that a
      -- publish while this one is live is a duplicate (above).
      redis.call('HDEL', KEYS[6], 'runs', 'rowed', 'owed', 'charged', 'missed')
    end
    if held[8] then
      -- An abandoned attempt's record written again (a dead-letter requeue, or a publish
      -- after the abandonment: abandon.lua): live again, so a publish beside it is a duplicate.
      redis.call('HDEL', KEYS[6], 'abandoned', 'missed')
    end
    redis.call('HSET', KEYS[6], 'nonce', ARGV[18], 'decision', decision, 'reason', reason,
      'window', admitted and ARGV[17] or '', 'tokens_in', ARGV[7], 'admitted_ms', ARGV[22],
      'published_ms', ARGV[19], 'deadline_ms', ARGV[21], 'dwell_s', shown, 'free_admitted', free,
      'reserved', admitted and capped or '0', 'prev_nonce', ARGV[24], 'label', ARGV[26])
    redis.call('EXPIRE', KEYS[6], ARGV[20])
  end
  -- An admission is counted in admitted_free alone (the review reads it as
  -- decided:admit_free:fits). The window's TTL is set by the write that creates the counter,
  -- and `hash_table` (WIDE) with it: a window of 25 fields, compact, cost 12% more.
  local counter = admitted and 'admitted_free' or 'decided:' .. decision .. ':' .. reason
  if redis.call('HINCRBY', KEYS[2], counter, '1') == 1 then
    redis.call('EXPIRE', KEYS[2], ARGV[12])
    redis.call('HSET', KEYS[2], 'hash_table', WIDE)
  end
  -- The lifetime total of the same decision, which never expires (Prometheus' counter). A
  -- new counter also writes `hash_table` (WIDE): the totals stay a hash table too (compact,
  -- at 300 counters they cost a decision 36% more instructions).
  if redis.call('HINCRBY', KEYS[8], 'decided:' .. decision .. ':' .. reason .. ':' .. ARGV[26],
      '1') == 1 then
    redis.call('HSET', KEYS[8], 'hash_table', WIDE)
  end
  if decision == 'defer' then  -- the nearest deadlines among deferred attempts
    redis.call('ZADD', KEYS[9], ARGV[21], ARGV[2])
    redis.call('ZREMRANGEBYRANK', KEYS[9], ARGV[27], '-1')
  end
  -- The free queue's age as this decision saw it: the window keeps the oldest, for the
  -- report's chart (0 written once: the window was decided here with the queue empty).
  seen = seen or redis.call('HMGET', KEYS[2], 'tax_units', 'exposure', 'free_age_max_ms')
  local age_ms = math.floor(age * 1000)
  if age_ms > tonumber(seen[3] or '-1') then
    redis.call('HSET', KEYS[2], 'free_age_max_ms', age_ms == 0 and '0' or age_ms)
  end
  -- The review's marks (gatekeeper/review.py review_marks): only finite inputs get here.
  if (reason == 'queue_age_cap' or reason == 'dwell_over_slack') and finite(dwell)
      and finite(slack) and finite(service) and finite(tax) then
    if reason == 'queue_age_cap' and slack > 0 and dwell <= slack then
      redis.call('HINCRBY', KEYS[2], 'review:defer_fit', '1')
    elseif decision == 'reserved' and reason == 'dwell_over_slack' and service + tax <= slack then
      redis.call('HINCRBY', KEYS[2], 'review:reserved_age_shift', '1')
    end
  end
  -- The decision record (gatekeeper tune): its inputs as this script saw them. The age in
  -- 17 digits, so that it reads back as the same double; the decision left empty (its reason
  -- says it: whatif.py DECIDED_BY), the default budget mode too. Best effort: a refused XADD
  -- (an ACL from before records, the key of another type) must not fail a decision whose
  -- writes are made (a script is not rolled back); it is counted in totals' records_refused.
  if ARGV[29] ~= '0' then
    local kept = redis.pcall('XADD', KEYS[10], 'MAXLEN', '~', ARGV[29], '*', 'd', '',
      'r', reason, 'j', ARGV[2], 'k', ARGV[26],
      'a', age == 0 and '0' or string.format('%.17g', age), 's', ARGV[3],
      'x', ARGV[4], 'l', ARGV[5], 'y', ARGV[16], 'n', ARGV[7], 'c', ARGV[6], 'b', ARGV[8],
      'u', ARGV[9], 'm', ARGV[10] == 'exposure' and '' or ARGV[10], 'tu', seen[1] or '0',
      'e', seen[2] or '0', 'p', ARGV[28])
    if type(kept) == 'table' and kept.err then
      redis.call('HINCRBY', KEYS[8], 'records_refused', '1')
    end
  end
  return {decision, reason, age == 0 and '0' or fmt(age), shown, projected, free}
end

if duplicate then
  return decided('reserved', 'duplicate_publish', nil, '0')
end
local flags = redis.call('HMGET', KEYS[5], 'free_path_enabled', 'initialised_at')
if not flags[2] then  -- the state marker is gone (lost, flushed) or was never written
  return decided('reserved', 'state_missing', nil, '0')
end
if flags[1] and flags[1] ~= 'true' then
  -- Closed unless it reads as true (gatekeeper/core/flagvalues.py closed_by: a corrupt value
  -- closes it): the commands write 'false', a hand's HSET may write '0' or 'off'.
  local text = string.lower(string.match(flags[1], '^%s*(.-)%s*$'))
  if not (text == 'true' or text == '1' or text == 'yes' or text == 'on') then
    return decided('reserved', 'free_path_disabled', nil, '0')
  end
end
if not (finite(service) and finite(tax) and finite(slack) and finite(cap) and finite(delay)) then
  return decided('defer', 'non_finite_input', nil, '0')
end
local dwell = age + service + tax + delay
if service <= 0 then return decided('defer', 'bad_service_guess', dwell, '0') end
if slack <= 0 then return decided('defer', 'deadline_passed', dwell, '0') end
if tax < 0 or cap < 0 or delay < 0 then return decided('defer', 'negative_input', dwell, '0') end
if age > cap then return decided('defer', 'queue_age_cap', dwell, '0') end
if dwell > slack then return decided('reserved', 'dwell_over_slack', dwell, '0') end

-- One read of the window for the budget, the record and the age chart.
seen = redis.call('HMGET', KEYS[2], 'tax_units', 'exposure', 'free_age_max_ms')
local exposure = 0
if ARGV[10] == 'exposure' then
  exposure = tonumber(seen[2] or '0')
end
local tax_units = 0
if seen[1] then tax_units = tonumber(seen[1]) end
local projected = tax_units + exposure + age * tonumber(ARGV[9])
-- The ceiling: an admission reserves what the attempt may still cost, its tokens and its wait
-- allowance (gatekeeper/core/ledger.py reservation), so that whatever it is charged later,
-- in whichever window it finishes, its admission window never goes over budget.
local reserve = tonumber(ARGV[7]) + (ARGV[10] == 'exposure' and tonumber(ARGV[25]) or 0)
local total = projected + reserve
local budget = tonumber(ARGV[8])
if not (finite(total) and finite(budget)) or total > budget then
  redis.call('HINCRBY', KEYS[2], 'rejected', '1')
  local row = '{"job_id": ' .. cjson.encode(ARGV[13]) .. ', "attempt": ' .. ARGV[14]
    .. ', "path": "free", "queue_wait_ms": 0, "tokens_in": 0, "tokens_out": 0'
    .. ', "outcome": "rejected", "deadline_slack_ms": ' .. ARGV[15] .. ', "retry_tax": 0.0}'
  redis.call('RPUSH', KEYS[3], row)
  redis.call('EXPIRE', KEYS[3], ARGV[12])
  return decided('reserved', 'retry_tax_budget', dwell, fmt(projected))
end

-- The reservation as text that reads back as the double the exposure grows by, so that
-- giving it back (release.lua, finish.lua, ...) leaves no residue: under 1e14 a whole
-- number's 14-digit text is its integer text (tostring, cheap: most reservations); else 17
-- digits (an integer's own digits up to 1e17).
local whole = reserve == math.floor(reserve) and reserve < 2 ^ 53 and reserve > -2 ^ 53
if whole and reserve < 1e14 and reserve > -1e14 then
  reserved = fmt(reserve)
else
  reserved = string.format('%.17g', reserve)
end
capped = ARGV[10] == 'exposure' and reserved or string.format('%.17g', reserve + tonumber(ARGV[25]))
-- Idempotent per attempt: a replay re-scored after a crash does not hold its tokens twice.
local held_now = reserved .. '|' .. ARGV[17] .. '|' .. ARGV[22] .. '|' .. WIDE
if redis.call('HSETNX', KEYS[4], ARGV[2], held_now) == 1 then
  -- A whole reservation takes HINCRBY (a fraction of HINCRBYFLOAT's cost); a fractional one,
  -- or a value some other writer left fractional, the float path.
  local amount = reserve == 0 and '0' or reserved  -- (not '-0')
  if not whole or type(redis.pcall('HINCRBY', KEYS[2], 'exposure', amount)) == 'table' then
    redis.call('HINCRBYFLOAT', KEYS[2], 'exposure', reserve)
  end
end
-- A delayed task joins the free queue's wait when it is due, not before. A set that had no
-- member gets the pad first, 'pad' and WIDE: past 64 bytes (zset-max-ziplist-value) a member
-- makes the set a skip list from its first member, where a compact one (up to 128 members)
-- was searched member by member on every ZADD (69 thousand instructions a decision at 10-130
-- in flight, against 6-8: bench/gate_ir.py --in-flight). It is never an attempt (it has no
-- ':<attempt>'), never the oldest (+inf: an age of 0, as an empty set) nor past the horizon;
-- readers of the set's size and head count scores below +inf.
if unpadded then redis.call('ZADD', KEYS[1], '+inf', 'pad' .. WIDE) end
redis.call('ZADD', KEYS[1], delay == 0 and ARGV[1] or now + delay * 1000, ARGV[2])
return decided('admit_free', 'fits', dwell, fmt(projected))
