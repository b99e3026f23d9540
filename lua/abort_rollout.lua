--[[
abort_rollout: drop a logical ID's rollout candidate; the current version serves all its traffic again.
The epoch does not move (the current version's cache namespace stays warm). An operator's `kvgate abort`
and the gate (gateway/proof/gate.py: the candidate failed its audit, or errs more than the current
version) both run it; the reason is kept in the history. Needs lua/lib/common.lua prepended (kvgate
does; `kvgate script abort_rollout` prints both).

KEYS[1]  kvg:{epochs}:state:ID     KEYS[2] kvg:{epochs}:history:ID
KEYS[3]  the change log      KEYS[4] its rows hash   KEYS[5] its check hash (lua/lib/common.lua)
ARGV[1]  logical ID          ARGV[2] now (ms)    ARGV[3] log entries kept    ARGV[4] history length kept
ARGV[5]  the candidate's digest, or a prefix of it ('' : whichever runs; the gate passes the one it
         judged, so it never aborts a newer rollout)
ARGV[6]  why (kept in the history and in the state's last_rollout field)

  redis-cli --eval /tmp/abort_rollout.lua 'kvg:{epochs}:state:tenant-42' 'kvg:{epochs}:history:tenant-42' \
    'kvg:{epochs}:log' 'kvg:{epochs}:rows' 'kvg:{epochs}:check' , tenant-42 "$(date +%s%3N)" 10000 100 '' operator

Returns {code, epoch, digest}:
  CODE.CHANGED             aborted: the candidate is dropped (logged)
  CODE.NO_CURRENT_VERSION  the logical ID has no current version
  CODE.NO_CANDIDATE        no rollout runs (or its candidate is not ARGV[5])
  CODE.MALFORMED           refused, nothing written (lua/lib/common.lua: {code, why})
]]
local why = odd_logged({{KEYS[1], 'hash'}, {KEYS[2], 'list'}}, KEYS[3], KEYS[4], KEYS[5],
  {{2, 'now (ms)'}, {3, 'log entries kept'}, {4, 'history length kept'}})
if why then
  return refuse(why)
end
local s = redis.call('HMGET', KEYS[1], 'digest', 'epoch', 'cand_digest', 'cand_base', 'cand_weight')
if not s[1] then
  return {CODE.NO_CURRENT_VERSION, 0, ''}
end
local wanted, reason = ARGV[5] or '', ARGV[6] or ''
if not s[3] or string.sub(s[3], 1, string.len(wanted)) ~= wanted then
  return {CODE.NO_CANDIDATE, tonumber(s[2]) or 0, ''}
end
drop_candidate(KEYS[1])
redis.call('HSET', KEYS[1], 'last_rollout', cjson.encode({digest = s[3], outcome = 'aborted', reason = reason,
  at_ms = tonumber(ARGV[2])}), 'updated_ms', ARGV[2])
append_rollout(KEYS[2], ARGV[4], tonumber(s[2]) or 0, s[3], s[4], 'abort', ARGV[2], s[5] or 0, reason)
log_change(KEYS[1], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'abort', ARGV[3])
return {CODE.CHANGED, tonumber(s[2]) or 0, s[3]}
