--[[
common: what every epoch-table script shares. It is not an operation of its own: kvgate prepends it to
each lua/*.lua when it registers the script, and `kvgate script NAME` prints the same assembled text
for operators (redis-cli --eval). Everything here is `local`: Redis scripts may not create globals.

CODE is the one table of status codes. gateway/table/scripts.py's Code is the same table in Python (a test
reads this one and checks the two agree) and maps each code to its exception there.
]]
local CODE = {
  CHANGED = 1,             -- the write happened (and was logged)
  UNCHANGED = 0,           -- already so: no write, nothing logged
  NO_CURRENT_VERSION = -1, -- the logical ID has no current version
  NO_SUCH_VERSION = -2,    -- never published for this base, or no earlier version to go back to
  AMBIGUOUS_PREFIX = -3,   -- a digest prefix matches more than one version
  PREFIX_TOO_SHORT = -4,   -- a digest prefix shorter than the minimum
  LEASED = -5,             -- a live lease holds the adapter: it may not be unloaded now
  UNLOADING = -6,          -- the adapter is being unloaded: no new lease on it
  CURRENT = -7,            -- the version is current (or the rollout candidate): it may not be forgotten
  NO_CANDIDATE = -8,       -- the logical ID has no rollout candidate (or another one than named)
  ROLLOUT_RUNNING = -9,    -- a rollout runs: another candidate (or a publish) must wait for promote or abort
  CANDIDATE_IS_CURRENT = -10, -- the rollout's bytes are already the current version
  MALFORMED = -11,         -- refused, nothing written: what Redis holds is not what the scripts write
}

--[[
Whole or absent. Redis does not undo a script's writes when one of its commands fails, so every script
reads and checks, before its first write, everything that could make one of its commands fail: each key's
type, each number it counts on (HINCRBY), the change log's last id (no XADD goes past it). What is odd (a
direct write with redis-cli, a bug elsewhere) refuses the call: the reply is {CODE.MALFORMED, why}, whatever
the script answers otherwise, and nothing is written (gateway/table/scripts.py raises ScriptRefused
with WHY). Writes that cannot fail once these checks pass (HSET, HDEL, LPUSH, LTRIM, PUBLISH) need no order;
a script that runs out of memory fails at its first write (Redis checks maxmemory there only).
]]
local function refuse(why)
  return {CODE.MALFORMED, why}
end

-- Why KEY is not of type WANT (a key that does not exist is of every type), or nil.
local function odd_type(key, want)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= want then
    return key .. ' is a ' .. kind .. ', not a ' .. want
  end
  return nil
end

-- The first why that ODD (odd_type, odd_arg) gives for one of ITEMS ({a, b}, ...), or nil.
local function first_odd(odd, items)
  for _, item in ipairs(items) do
    local why = odd(item[1], item[2])
    if why then
      return why
    end
  end
  return nil
end

-- Why one of KINDS ({key, type}, ...) is of another type, or nil.
local function odd_types(kinds)
  return first_odd(odd_type, kinds)
end

-- VALUE as a number if it is an integer as Redis writes one (what HINCRBY accepts), else nil.
local function redis_integer(value)
  if type(value) ~= 'string' or string.len(value) > 20 then
    return nil
  end
  if value == '0' or string.match(value, '^-?[1-9]%d*$') then
    return tonumber(value)
  end
  return nil
end

local EXACT = 2 ^ 53  -- Lua numbers are doubles: whole numbers below this are exact

-- Why FIELD of hash KEY (VALUE as read; false: absent, counted from 0) is not a whole number (as Redis
-- writes one) within +-LIMIT (LIMIT_TEXT: how the message says it), or nil.
local function odd_count(key, field, value, limit, limit_text)
  if not value then
    return nil
  end
  local n = redis_integer(value)
  if not n or math.abs(n) >= limit then
    return key .. ' field ' .. field .. ' is ' .. string.format('%q', value) .. ', not a whole number within +-'
      .. limit_text
  end
  return nil
end

-- Why VALUE (the ARGV at INDEX, WHAT it is) is not a whole number, or nil.
local function odd_arg(index, what)
  local value = ARGV[index]
  if type(value) ~= 'string' or not string.match(value, '^%d+$') or string.len(value) > 15 then
    return 'ARGV[' .. index .. '] (' .. what .. ') is ' .. string.format('%q', tostring(value))
      .. ', not a whole number'
  end
  return nil
end

-- Why one of the whole-number arguments ({index, what}, ...) is not one, or nil.
local function odd_args(args)
  return first_odd(odd_arg, args)
end

-- A rollout's candidate lives in the ID's state hash beside the current version, in these fields (all
-- or none): its digest, versioned name, store path, base, base fingerprint and weight (basis points of
-- the traffic, 0..10000). Its epoch is always the state's epoch + 1: the epoch a promote gives it, so
-- its cache namespace carries over to the promoted version, and a bump moves it too. The last field,
-- cand_split (what its requests are split by: SPLIT_KEYS), is absent in a rollout stored before it was
-- (split by the default) and then not in the row's hash either.
local CANDIDATE_FIELDS = {'cand_digest', 'cand_name', 'cand_path', 'cand_base', 'cand_base_print',
  'cand_weight', 'cand_split'}
local CANDIDATE_REQUIRED = 6  -- the first six: all or none
local SPLIT_KEYS = {user = true, ['api-key'] = true, conversation = true}  -- gateway/core/split.py's
local DEFAULT_SPLIT = 'user'

local function drop_candidate(state)
  redis.call('HDEL', state, unpack(CANDIDATE_FIELDS))
end

-- Leases live in one hash per replica, field '<versioned name>|<gateway id>' -> expiry (ms); the field
-- '<versioned name>|!unloading' marks an unload in progress. A versioned name never contains '|'.
-- An expiry that is not a whole number of ms (a direct write) counts as expired, wherever it is read.
local UNLOADING_MARK = '!unloading'

-- A stored time in ms, or nil when VALUE is not one (digits only: tonumber takes 'NaN', 'inf', '0x10').
local function stored_ms(value)
  if type(value) == 'string' and string.match(value, '^%d+$') then
    return tonumber(value)
  end
  return nil
end

local function lease_field(name, owner)
  return name .. '|' .. owner
end

-- Live leases on NAME of gateways other than OWNER (who counts its own requests itself), deleting the
-- expired ones met on the way.
local function live_leases(key, name, owner, now)
  local live = 0
  local prefix = name .. '|'
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    local field, expiry = fields[i], stored_ms(fields[i + 1]) or 0
    local other = field ~= lease_field(name, UNLOADING_MARK) and field ~= lease_field(name, owner)
    if string.sub(field, 1, string.len(prefix)) == prefix and other then
      if expiry > tonumber(now) then
        live = live + 1
      else
        redis.call('HDEL', key, field)
      end
    end
  end
  return live
end

-- kvg:{ID}:versions is keyed by (base, digest): field '<base>|<digest>'. A digest is always 64 hex
-- characters, so the base is everything before the last 65 characters, whatever it contains.
local DIGEST_LENGTH = 64

local function version_field(base, digest)
  return base .. '|' .. digest
end

-- The digest of a versions field if it belongs to BASE, else nil.
local function digest_for_base(field, base)
  if string.len(field) ~= string.len(base) + 1 + DIGEST_LENGTH then
    return nil
  end
  if string.sub(field, 1, string.len(base) + 1) ~= base .. '|' then
    return nil
  end
  return string.sub(field, -DIGEST_LENGTH)
end

-- Append one event (a table) to a history list (newest first) and keep only its newest KEEP entries.
local function append_event(key, keep, event)
  redis.call('LPUSH', key, cjson.encode(event))
  redis.call('LTRIM', key, 0, tonumber(keep) - 1)
end

local function append_history(key, keep, epoch, digest, base, action, now)
  append_event(key, keep, {epoch = epoch, digest = digest, base = base, action = action, at_ms = tonumber(now)})
end

-- A rollout's event (role 'candidate': rollout, weight, abort; a rollback's automatic target skips them).
-- SPLIT: a started rollout's split key (nil: not recorded in the event).
local function append_rollout(key, keep, epoch, digest, base, action, now, weight, reason, split)
  append_event(key, keep, {epoch = epoch, digest = digest, base = base, action = action, at_ms = tonumber(now),
    role = 'candidate', weight = tonumber(weight), reason = reason or '', split = split})
end

-- The change log. A row is what a kvgate's snapshot holds of one logical ID; its hash is 40 bits of a
-- SHA-1 (gateway/table/changelog.py's row_hash computes the same), 0 when the ID has no state. Sums of
-- 40-bit rows fit a 64-bit HINCRBY for millions of IDs.
-- CAND: the CANDIDATE_FIELDS' values in order (a row without a candidate hashes as it did before them).
local function row_hash(id, digest, epoch, base, name, path, base_print, cand)
  if not digest then
    return 0
  end
  local parts = {id, digest, epoch or '', base or '', name or '', path or '', base_print or ''}
  if cand and cand[1] then
    for i = 1, #CANDIDATE_FIELDS do
      if i <= CANDIDATE_REQUIRED or cand[i] then
        parts[#parts + 1] = cand[i] or ''
      end
    end
  end
  local text = table.concat(parts, '\n')
  return tonumber(string.sub(redis.sha1hex(text), 1, 10), 16)
end

local ROW_LIMIT = 2 ^ 40  -- a row hash is below it
local SUM_LIMIT = 2 ^ 63 - 2 ^ 41  -- a sum this far inside int64 takes any row's change without overflow
-- A stream's last possible id is LAST_MS-18446744073709551615. A log whose last id is in that millisecond (a
-- direct XADD: kvgate's ids are the clock's) is refused: a script's XADDs could run out of ids half way.
local LAST_MS = '18446744073709551615'

-- Why LOG can take no more entries (its last id in its last possible millisecond), or nil.
local function odd_log_full(log)
  if redis.call('EXISTS', log) == 1 then
    local info = redis.call('XINFO', 'STREAM', log)
    for i = 1, #info, 2 do
      local value = info[i + 1]
      if info[i] == 'last-generated-id' and string.sub(value, 1, string.len(LAST_MS) + 1) == LAST_MS .. '-' then
        return log .. ' is at ' .. value .. ', its last possible millisecond: no entry can follow'
      end
    end
  end
  return nil
end

-- odd_logged without the full log: the keys' types, the arguments and the sum (what the heartbeat needs
-- before its read-only part; it checks odd_log_full only once it has a drift entry to append).
local function odd_logged_keys(kinds, log, rows, check, args)
  local all = {{log, 'stream'}, {rows, 'hash'}, {check, 'hash'}}
  for _, kind in ipairs(kinds) do
    all[#all + 1] = kind
  end
  return odd_args(args) or odd_types(all)
    or odd_count(check, 'sum', redis.call('HGET', check, 'sum'), SUM_LIMIT, '(2^63 - 2^41)')
end

-- Why a logged change (log_change) could fail half way, or nil: one of KINDS (the script's own keys,
-- {key, type}, ...) or the change log's keys (LOG, ROWS, CHECK) of another type, CHECK's sum no count
-- to add a row to, LOG at its last possible millisecond, or one of ARGS (the script's whole-number
-- arguments, {index, what}, ...) not a number.
local function odd_logged(kinds, log, rows, check, args)
  return odd_logged_keys(kinds, log, rows, check, args) or odd_log_full(log)
end

-- Why STATE's epoch (EPOCH as read) cannot be counted on by HINCRBY, or nil.
local function odd_epoch(state, epoch)
  return odd_count(state, 'epoch', epoch, EXACT, '2^53')
end

-- After a change to ID's state hash STATE: append one entry to the stream LOG (id, action, then the state
-- as it stands now; no state fields when it is gone), trimmed to about KEEP entries, and keep ROWS (ID ->
-- row hash) and CHECK (sum of the rows; last: the newest entry's id) in step. Returns the entry's id.
local function log_change(state, log, rows, check, id, action, keep)
  local fields = redis.pcall('HGETALL', state)
  if fields.err then
    fields = {}  -- not a hash (a direct write of another type): logged as no state
  end
  local entry = {'XADD', log, 'MAXLEN', '~', keep, '*', 'id', id, 'action', action}
  local row = {}
  for i = 1, #fields, 2 do
    entry[#entry + 1] = fields[i]
    entry[#entry + 1] = fields[i + 1]
    row[fields[i]] = fields[i + 1]
  end
  local cand = {}
  for i, name in ipairs(CANDIDATE_FIELDS) do
    cand[i] = row[name]
  end
  local new = row_hash(id, row.digest, row.epoch, row.base, row.name, row.path, row.base_print, cand)
  local old = stored_ms(redis.call('HGET', rows, id)) or 0  -- malformed: the checksum then disagrees
  if old >= ROW_LIMIT then
    old = 0
  end
  if new == 0 then
    redis.call('HDEL', rows, id)
  else
    redis.call('HSET', rows, id, string.format('%d', new))
  end
  redis.call('HINCRBY', check, 'sum', string.format('%d', new - old))
  local at = redis.call(unpack(entry))
  redis.call('HSET', check, 'last', at)
  return at
end
