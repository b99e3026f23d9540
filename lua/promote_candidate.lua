--[[
promote_candidate: make a logical ID's rollout candidate its current version (a new epoch), atomically.
The new epoch is the one the candidate already ran in (the state's epoch + 1), so its cache namespace,
and what its replicas cached during the rollout, carry over. Needs lua/lib/common.lua prepended (kvgate
does; `kvgate script promote_candidate` prints both).

KEYS[1]  kvg:{epochs}:state:ID     KEYS[2] kvg:{epochs}:history:ID
KEYS[3]  the change log      KEYS[4] its rows hash   KEYS[5] its check hash (lua/lib/common.lua)
ARGV[1]  logical ID          ARGV[2] now (ms)    ARGV[3] log entries kept    ARGV[4] history length kept
ARGV[5]  the candidate's digest, or a prefix of it, that the caller means ('' : whichever runs)

  redis-cli --eval /tmp/promote_candidate.lua 'kvg:{epochs}:state:tenant-42' 'kvg:{epochs}:history:tenant-42' \
    'kvg:{epochs}:log' 'kvg:{epochs}:rows' 'kvg:{epochs}:check' , tenant-42 "$(date +%s%3N)" 10000 100 ''

Returns {code, epoch, digest}:
  CODE.CHANGED             promoted: the candidate is current under a new epoch (logged)
  CODE.NO_CURRENT_VERSION  the logical ID has no current version
  CODE.NO_CANDIDATE        no rollout runs (or its candidate is not ARGV[5])
  CODE.MALFORMED           refused, nothing written: also half a candidate (lua/lib/common.lua: {code, why})
]]
local why = odd_logged({{KEYS[1], 'hash'}, {KEYS[2], 'list'}}, KEYS[3], KEYS[4], KEYS[5],
  {{2, 'now (ms)'}, {3, 'log entries kept'}, {4, 'history length kept'}})
if why then
  return refuse(why)
end
local s = redis.call('HMGET', KEYS[1], 'digest', 'cand_digest', 'cand_name', 'cand_path', 'cand_base',
  'cand_base_print', 'epoch')
if not s[1] then
  return {CODE.NO_CURRENT_VERSION, 0, ''}
end
local wanted = ARGV[5] or ''
if not s[2] or string.sub(s[2], 1, string.len(wanted)) ~= wanted then
  return {CODE.NO_CANDIDATE, 0, ''}
end
why = odd_epoch(KEYS[1], s[7])
for i, field in ipairs({'cand_name', 'cand_path', 'cand_base'}) do
  why = why or (not s[i + 2] and KEYS[1] .. ' has a candidate without ' .. field)
end
if why then
  return refuse(why)
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'digest', s[2], 'name', s[3], 'path', s[4], 'base', s[5], 'base_print', s[6] or '',
  'updated_ms', ARGV[2])
drop_candidate(KEYS[1])
redis.call('HSET', KEYS[1], 'last_rollout', cjson.encode({digest = s[2], outcome = 'promoted', reason = '',
  at_ms = tonumber(ARGV[2])}))
append_history(KEYS[2], ARGV[4], epoch, s[2], s[5], 'promote', ARGV[2])
log_change(KEYS[1], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'promote', ARGV[3])
return {CODE.CHANGED, epoch, s[2]}
