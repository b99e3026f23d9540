--[[
reseed_version: put back the version a kvgate's snapshot held for a logical ID, after the table came
back empty (a new generation: FLUSHALL, or Redis restarted without its data), atomically.
It writes only when the logical ID has no current version, or one that only a reseed wrote, at a lower
epoch: any number of kvgates may run it for the same ID, in any order, and the table ends at the
freshest version their snapshots held (the highest epoch), each write once. Anything else that wrote
the ID since (a publish, a rollback, a bump: each moves the epoch off reseeded_epoch) wins.
The kvgate passes only what it can prove: a version whose content-addressed store directory exists.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script reseed_version` prints both).

KEYS[1]  kvg:{epochs}:state:ID     KEYS[2] kvg:{epochs}:versions:ID     KEYS[3] kvg:{epochs}:history:ID
KEYS[4]  the change log      KEYS[5] its rows hash         KEYS[6] its check hash (lua/lib/common.lua)
ARGV[1]  logical ID          ARGV[2] digest (64 hex)        ARGV[3] versioned name
ARGV[4]  store path          ARGV[5] base identity          ARGV[6] the epoch the snapshot held
ARGV[7]  now (ms)            ARGV[8] log entries kept           ARGV[9] history length kept

Returns {code, epoch}:
  CODE.CHANGED    re-seeded at epoch ARGV[6] (state.reseeded_epoch = it): a 'reseeded' history event
                  and a change-log entry
  CODE.UNCHANGED  the ID has a version that stays (no write, nothing logged); epoch is its epoch
  CODE.MALFORMED  refused, nothing written (lua/lib/common.lua: {code, why})
]]
local id, digest, name, path, base, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[7]
local why = odd_logged({{KEYS[1], 'hash'}, {KEYS[2], 'hash'}, {KEYS[3], 'list'}}, KEYS[4], KEYS[5], KEYS[6],
  {{6, 'epoch'}, {7, 'now (ms)'}, {8, 'log entries kept'}, {9, 'history length kept'}})
if why then
  return refuse(why)
end
local epoch = tonumber(ARGV[6])
local current = redis.call('HMGET', KEYS[1], 'digest', 'epoch', 'reseeded_epoch')
if current[1] then
  local in_force = tonumber(current[2]) or 0  -- a malformed epoch: no epoch of its own
  local only_reseeded = current[3] and tonumber(current[3]) == in_force
  if not (only_reseeded and epoch > in_force) then
    return {CODE.UNCHANGED, in_force}
  end
end
redis.call('HSET', KEYS[2], version_field(base, digest),
  cjson.encode({name = name, path = path, base = base, published_ms = tonumber(now)}))
redis.call('HSET', KEYS[1], 'digest', digest, 'name', name, 'path', path, 'base', base, 'epoch', epoch,
  'reseeded_epoch', epoch, 'updated_ms', now)
append_history(KEYS[3], ARGV[9], epoch, digest, base, 'reseeded', now)
log_change(KEYS[1], KEYS[4], KEYS[5], KEYS[6], id, 'reseeded', ARGV[8])
return {CODE.CHANGED, epoch}
