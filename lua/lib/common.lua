--[[
common: what every epoch-table script shares. It is not an operation of its own: kvgate prepends it to
each lua/*.lua when it registers the script, and `kvgate script NAME` prints the same assembled text
for operators (redis-cli --eval). Everything here is `local`: Redis scripts may not create globals.

CODE is the one table of status codes. The Python wrapper reads it from this file
(gateway/table/epoch_table.py) to map codes to exceptions, so a code is written down only here.
]]
local CODE = {
  CHANGED = 1,             -- the write happened (a hint was published)
  UNCHANGED = 0,           -- already so: no write, no hint
  NO_CURRENT_VERSION = -1, -- the logical ID has no current version
  NO_SUCH_VERSION = -2,    -- never published for this base, or no earlier version to go back to
  AMBIGUOUS_PREFIX = -3,   -- a digest prefix matches more than one version
  PREFIX_TOO_SHORT = -4,   -- a digest prefix shorter than the minimum
  LEASED = -5,             -- a live lease holds the adapter: it may not be unloaded now
  UNLOADING = -6,          -- the adapter is being unloaded: no new lease on it
  CURRENT = -7,            -- the version is current: it may not be forgotten
}

-- Leases live in one hash per replica, field '<versioned name>|<gateway id>' -> expiry (ms); the field
-- '<versioned name>|!unloading' marks an unload in progress. A versioned name never contains '|'.
local UNLOADING_MARK = '!unloading'

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
    local field, expiry = fields[i], tonumber(fields[i + 1])
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

-- Append one event to a history list (newest first) and keep only its newest KEEP entries.
local function append_history(key, keep, epoch, digest, base, action, now)
  redis.call('LPUSH', key, cjson.encode({epoch = epoch, digest = digest, base = base, action = action,
    at_ms = tonumber(now)}))
  redis.call('LTRIM', key, 0, tonumber(keep) - 1)
end
