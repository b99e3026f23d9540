--[[
rollout_version: start a rollout (DIGEST, built for BASE, becomes the logical ID's candidate beside its
current version, at WEIGHT) or, with DIGEST '', change the running rollout's weight; atomically.
The current version keeps serving the rest; each kvgate sends a request to the candidate when a stable
hash of (ID, its split key) falls under the weight (gateway/core/split.py), so raising the weight only
moves keys from the current version to the candidate. Needs lua/lib/common.lua prepended (kvgate does;
`kvgate script rollout_version` prints both).

KEYS[1]  kvg:{epochs}:state:ID     KEYS[2] kvg:{epochs}:versions:ID     KEYS[3] kvg:{epochs}:history:ID
KEYS[4]  the change log      KEYS[5] its rows hash         KEYS[6] its check hash (lua/lib/common.lua)
ARGV[1]  logical ID          ARGV[2] digest (64 hex), or '' to change the weight only
ARGV[3]  versioned name      ARGV[4] store path            ARGV[5] base identity (ARGV[3..5]: '' with no digest)
ARGV[6]  now (ms)            ARGV[7] log entries kept      ARGV[8] history length kept
ARGV[9]  base fingerprint ('' : none)                      ARGV[10] weight: basis points, 0..10000
ARGV[11] split key: user, api-key or conversation (SPLIT_KEYS; gateway/core/split.py); '' (or absent):
         the running rollout's, or for a new one the default, user

Example, straight through Redis (25%, the candidate already in the store and recorded by a rollout):
  redis-cli --eval /tmp/rollout_version.lua 'kvg:{epochs}:state:tenant-42' 'kvg:{epochs}:versions:tenant-42' \
    'kvg:{epochs}:history:tenant-42' 'kvg:{epochs}:log' 'kvg:{epochs}:rows' 'kvg:{epochs}:check' , \
    tenant-42 '' '' '' '' "$(date +%s%3N)" 10000 100 '' 2500

Returns {code, epoch, weight, split key} (the split key in effect: CHANGED and UNCHANGED only):
  CODE.CHANGED               the candidate was set, or its weight changed (logged)
  CODE.UNCHANGED             that candidate at that weight already (no write, nothing logged)
  CODE.NO_CURRENT_VERSION    the logical ID has no current version to roll out beside
  CODE.NO_CANDIDATE          a weight change with no rollout running
  CODE.ROLLOUT_RUNNING       another candidate is rolling out, or this one by another split key: promote or
                             abort it first
  CODE.CANDIDATE_IS_CURRENT  DIGEST for BASE is already the current version
  CODE.MALFORMED             refused, nothing written (lua/lib/common.lua: {code, why})
]]
local id, digest, name, path, base, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local base_print, weight, split = ARGV[9] or '', tonumber(ARGV[10]), ARGV[11] or ''
if not weight or weight < 0 or weight > 10000 or weight ~= math.floor(weight) then
  return redis.error_reply('weight must be a whole number of basis points, 0..10000')
end
if split ~= '' and not SPLIT_KEYS[split] then
  return redis.error_reply('split key ' .. string.format('%q', split)
    .. ' is not one of user, api-key, conversation')
end
local why = odd_logged({{KEYS[1], 'hash'}, {KEYS[2], 'hash'}, {KEYS[3], 'list'}}, KEYS[4], KEYS[5], KEYS[6],
  {{6, 'now (ms)'}, {7, 'log entries kept'}, {8, 'history length kept'}})
if why then
  return refuse(why)
end
local s = redis.call('HMGET', KEYS[1], 'digest', 'base', 'epoch', 'base_print', 'cand_digest', 'cand_base',
  'cand_base_print', 'cand_weight', 'cand_split')
if not s[1] then
  return {CODE.NO_CURRENT_VERSION, 0, 0}
end
local epoch = tonumber(s[3]) or 0
-- the running rollout (a weight change) when DIGEST is '' or its candidate, SPLIT '' or its split key (a
-- rollout stored before split keys were splits by the default, user)
local same = s[5] and (split == '' or split == (s[9] or DEFAULT_SPLIT))
  and (digest == '' or (s[5] == digest and s[6] == base and (s[7] or '') == base_print))
if digest == '' and not s[5] then
  return {CODE.NO_CANDIDATE, epoch, 0}
end
if same then
  if tonumber(s[8]) == weight then
    return {CODE.UNCHANGED, epoch, weight, s[9] or DEFAULT_SPLIT}
  end
  redis.call('HSET', KEYS[1], 'cand_weight', string.format('%d', weight), 'updated_ms', now)
  append_rollout(KEYS[3], ARGV[8], epoch, s[5], s[6], 'weight', now, weight, '')
  log_change(KEYS[1], KEYS[4], KEYS[5], KEYS[6], id, 'weight', ARGV[7])
  return {CODE.CHANGED, epoch, weight, s[9] or DEFAULT_SPLIT}
end
if s[5] then
  return {CODE.ROLLOUT_RUNNING, epoch, tonumber(s[8]) or 0}
end
if s[1] == digest and s[2] == base then
  return {CODE.CANDIDATE_IS_CURRENT, epoch, 0}
end
if split == '' then
  split = DEFAULT_SPLIT
end
redis.call('HSET', KEYS[2], version_field(base, digest),
  cjson.encode({name = name, path = path, base = base, base_print = base_print, published_ms = tonumber(now)}))
redis.call('HSET', KEYS[1], 'cand_digest', digest, 'cand_name', name, 'cand_path', path, 'cand_base', base,
  'cand_base_print', base_print, 'cand_weight', string.format('%d', weight), 'cand_split', split,
  'updated_ms', now)
append_rollout(KEYS[3], ARGV[8], epoch, digest, base, 'rollout', now, weight, '', split)
log_change(KEYS[1], KEYS[4], KEYS[5], KEYS[6], id, 'rollout', ARGV[7])
return {CODE.CHANGED, epoch, weight, split}
