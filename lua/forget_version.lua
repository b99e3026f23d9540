--[[
forget_version: drop every version record of DIGEST under one logical ID (any base), unless it is current
(or the rollout's candidate).
`kvgate gc` runs it before it deletes DIGEST's store directory, so a rollback can never point the table at
bytes that are gone: a rollback that ran first made DIGEST current (refused here, gc keeps the bytes); one
that runs after finds no such version. Needs lua/lib/common.lua prepended (`kvgate script forget_version`).

KEYS[1]  kvg:{epochs}:state:ID     KEYS[2] kvg:{epochs}:versions:ID
ARGV[1]  digest (64 hex)

Returns {code, forgotten}:
  CODE.CHANGED    the records were dropped (forgotten: how many; 0 if there were none)
  CODE.CURRENT    DIGEST is the logical ID's current version or its rollout candidate: nothing dropped
  CODE.MALFORMED  refused, nothing written (lua/lib/common.lua: {code, why})
]]
local why = odd_types({{KEYS[1], 'hash'}, {KEYS[2], 'hash'}})
if why then
  return refuse(why)
end
local digest = ARGV[1]
local state = redis.call('HMGET', KEYS[1], 'digest', 'cand_digest')
if state[1] == digest or state[2] == digest then
  return {CODE.CURRENT, 0}
end
local forgotten = 0
local fields = redis.call('HKEYS', KEYS[2])
for _, field in ipairs(fields) do
  if string.len(field) > DIGEST_LENGTH and string.sub(field, -DIGEST_LENGTH) == digest
      and string.sub(field, -DIGEST_LENGTH - 1, -DIGEST_LENGTH - 1) == '|' then
    redis.call('HDEL', KEYS[2], field)
    forgotten = forgotten + 1
  end
end
return {CODE.CHANGED, forgotten}
