--[[
publish_version: make DIGEST, built for BASE, the current version of a logical ID (a new epoch), atomically.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script publish_version` prints both).

KEYS[1]  kvg:{ID}:state     hash: digest, name, path, base, base_print, epoch, updated_ms
KEYS[2]  kvg:{ID}:versions  hash: '<base>|<digest>' -> JSON {name, path, base, base_print, published_ms}
KEYS[3]  kvg:{ID}:history   list of JSON events {epoch, digest, base, action, at_ms}, newest first
ARGV[1]  logical ID          ARGV[2] digest (64 hex)  ARGV[3] versioned name
ARGV[4]  store path          ARGV[5] base identity    ARGV[6] now (ms)
ARGV[7]  hint channel        ARGV[8] history length kept
ARGV[9]  base fingerprint (gateway/core/base_print.py; '' when published without one)

Returns {code, epoch}:
  CODE.CHANGED    published: DIGEST for BASE is current under a new epoch (a hint was published)
  CODE.UNCHANGED  DIGEST with the same base (and base fingerprint) was already current (no write, no hint)
The version record of (BASE, DIGEST) is rewritten on every publish, so it always holds the latest one.
]]
local id, digest, name, path, base, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local base_print = ARGV[9] or ''
local current = redis.call('HMGET', KEYS[1], 'digest', 'base', 'epoch', 'base_print')
if current[1] == digest and current[2] == base and (current[4] or '') == base_print then
  return {CODE.UNCHANGED, tonumber(current[3])}
end
redis.call('HSET', KEYS[2], version_field(base, digest),
  cjson.encode({name = name, path = path, base = base, base_print = base_print, published_ms = tonumber(now)}))
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'digest', digest, 'name', name, 'path', path, 'base', base,
  'base_print', base_print, 'updated_ms', now)
append_history(KEYS[3], ARGV[8], epoch, digest, base, 'publish', now)
redis.call('PUBLISH', ARGV[7], id)
return {CODE.CHANGED, epoch}
