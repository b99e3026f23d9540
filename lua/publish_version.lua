--[[
publish_version: make DIGEST, built for BASE, the current version of a logical ID (a new epoch), atomically.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script publish_version` prints both).

KEYS[1]  kvg:{epochs}:state:ID     hash: digest, name, path, base, base_print, epoch, updated_ms
KEYS[2]  kvg:{epochs}:versions:ID  hash: '<base>|<digest>' -> JSON {name, path, base, base_print, published_ms}
KEYS[3]  kvg:{epochs}:history:ID   list of JSON events {epoch, digest, base, action, at_ms}, newest first
KEYS[4]  the change log      KEYS[5] its rows hash       KEYS[6] its check hash (lua/lib/common.lua)
ARGV[1]  logical ID          ARGV[2] digest (64 hex)  ARGV[3] versioned name
ARGV[4]  store path          ARGV[5] base identity    ARGV[6] now (ms)
ARGV[7]  log entries kept     ARGV[8] history length kept
ARGV[9]  base fingerprint (gateway/core/base_print.py; '' when published without one)

Returns {code, epoch}:
  CODE.CHANGED    published: DIGEST for BASE is current under a new epoch (logged)
  CODE.UNCHANGED  DIGEST with the same base (and base fingerprint) was already current (no write, nothing logged)
  CODE.ROLLOUT_RUNNING  a rollout runs for the ID (lua/rollout_version.lua): promote or abort it first
  CODE.MALFORMED  refused, nothing written: a key of another type, an epoch or checksum no number, the log at
                  its last id (lua/lib/common.lua: {code, why})
The version record of (BASE, DIGEST) is rewritten on every publish, so it always holds the latest one.
]]
local id, digest, name, path, base, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local base_print = ARGV[9] or ''
local why = odd_logged({{KEYS[1], 'hash'}, {KEYS[2], 'hash'}, {KEYS[3], 'list'}}, KEYS[4], KEYS[5], KEYS[6],
  {{6, 'now (ms)'}, {7, 'log entries kept'}, {8, 'history length kept'}})
if why then
  return refuse(why)
end
local current = redis.call('HMGET', KEYS[1], 'digest', 'base', 'epoch', 'base_print', 'cand_digest')
why = odd_epoch(KEYS[1], current[3])
if why then
  return refuse(why)
end
if current[1] == digest and current[2] == base and (current[4] or '') == base_print then
  return {CODE.UNCHANGED, tonumber(current[3]) or 0}
end
if current[5] then
  return {CODE.ROLLOUT_RUNNING, tonumber(current[3]) or 0}
end
redis.call('HSET', KEYS[2], version_field(base, digest),
  cjson.encode({name = name, path = path, base = base, base_print = base_print, published_ms = tonumber(now)}))
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'digest', digest, 'name', name, 'path', path, 'base', base,
  'base_print', base_print, 'updated_ms', now)
append_history(KEYS[3], ARGV[8], epoch, digest, base, 'publish', now)
log_change(KEYS[1], KEYS[4], KEYS[5], KEYS[6], id, 'publish', ARGV[7])
return {CODE.CHANGED, epoch}
