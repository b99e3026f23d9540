--[[
rollback_version: point a logical ID back at an earlier version published for BASE (a new epoch), atomically.
Only versions published for BASE are candidates: the same digest published for another base is another
version. Needs lua/lib/common.lua prepended (kvgate does; `kvgate script rollback_version` prints both).

KEYS[1]  kvg:{epochs}:state:ID     KEYS[2] kvg:{epochs}:versions:ID     KEYS[3] kvg:{epochs}:history:ID
KEYS[4]  the change log      KEYS[5] its rows hash         KEYS[6] its check hash (lua/lib/common.lua)
ARGV[1]  logical ID
ARGV[2]  target digest, or a unique prefix of one (at least ARGV[7] characters), or '' for the newest
         version of BASE in the history that is not the current one (a rollout's events, role
         'candidate', do not count: that version was never current)
A rollback during a rollout ends it: the candidate is dropped, an 'abort' event (reason 'rollback') logged.
ARGV[3]  base identity BASE the rollback stays within
ARGV[4]  now (ms)            ARGV[5] log entries kept          ARGV[6] history length kept
ARGV[7]  shortest digest prefix accepted (kvgate passes 8)

Returns {code, epoch, digest}:
  CODE.CHANGED             rolled back: the target is current under a new epoch (logged)
  CODE.UNCHANGED           the target (same digest, same base) is already current
  CODE.NO_CURRENT_VERSION  the logical ID has no current version
  CODE.NO_SUCH_VERSION     no such version for BASE (never published for it, or none earlier to go back to)
  CODE.AMBIGUOUS_PREFIX    the digest prefix matches more than one version of BASE
  CODE.PREFIX_TOO_SHORT    the digest prefix is shorter than ARGV[7] (refused even if it matches)
  CODE.MALFORMED           refused, nothing written: also a version record that is not one
                           (lua/lib/common.lua: {code, why})
]]
local id, wanted, base, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local why = odd_logged({{KEYS[1], 'hash'}, {KEYS[2], 'hash'}, {KEYS[3], 'list'}}, KEYS[4], KEYS[5], KEYS[6],
  {{4, 'now (ms)'}, {5, 'log entries kept'}, {6, 'history length kept'}, {7, 'shortest prefix'}})
if why then
  return refuse(why)
end
local current = redis.call('HMGET', KEYS[1], 'digest', 'base', 'epoch')
if not current[1] then
  return {CODE.NO_CURRENT_VERSION, 0, ''}
end
why = odd_epoch(KEYS[1], current[3])
if why then
  return refuse(why)
end
local function is_current(digest)
  return digest == current[1] and base == current[2]
end
local target = nil
if wanted == '' then
  for _, raw in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do
    local ok, event = pcall(cjson.decode, raw)  -- an event that is not JSON (a direct write) is skipped
    if ok and type(event) == 'table' and event.base == base and type(event.digest) == 'string'
        and event.role ~= 'candidate' and not is_current(event.digest) then
      target = event.digest
      break
    end
  end
elseif string.len(wanted) < tonumber(ARGV[7]) then
  return {CODE.PREFIX_TOO_SHORT, 0, ''}
else
  for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
    local digest = digest_for_base(field, base)
    if digest and string.sub(digest, 1, string.len(wanted)) == wanted then
      if target then
        return {CODE.AMBIGUOUS_PREFIX, 0, ''}
      end
      target = digest
    end
  end
end
local record = target and redis.call('HGET', KEYS[2], version_field(base, target))
if not record then
  return {CODE.NO_SUCH_VERSION, 0, ''}
end
if is_current(target) then
  return {CODE.UNCHANGED, tonumber(current[3]) or 0, target}
end
local ok, version = pcall(cjson.decode, record)
if not ok or type(version) ~= 'table' or type(version.name) ~= 'string' or type(version.path) ~= 'string'
    or (version.base_print ~= nil and type(version.base_print) ~= 'string') then
  return refuse(KEYS[2] .. ' field ' .. version_field(base, target) .. ' is not a version record (JSON with'
    .. ' name and path)')
end
local candidate = redis.call('HMGET', KEYS[1], 'cand_digest', 'cand_base', 'cand_weight')
if candidate[1] then
  drop_candidate(KEYS[1])
  redis.call('HSET', KEYS[1], 'last_rollout', cjson.encode({digest = candidate[1], outcome = 'aborted',
    reason = 'rollback', at_ms = tonumber(now)}))
  append_rollout(KEYS[3], ARGV[6], tonumber(current[3]) or 0, candidate[1], candidate[2], 'abort', now,
    candidate[3] or 0, 'rollback')
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'digest', target, 'name', version.name, 'path', version.path,
  'base', base, 'base_print', version.base_print or '', 'updated_ms', now)
append_history(KEYS[3], ARGV[6], epoch, target, base, 'rollback', now)
log_change(KEYS[1], KEYS[4], KEYS[5], KEYS[6], id, 'rollback', ARGV[5])
return {CODE.CHANGED, epoch, target}
