--[[
heartbeat: what a kvgate compares its snapshot with, once a heartbeat, plus one step of the shared scrub.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script heartbeat` prints both).

The scripts keep CHECK's sum (of every ID's row hash) and last (the newest change-log entry) in step with
the table, so a kvgate that has read the log up to `last` must hold rows summing to `sum`; a mismatch
means its snapshot went wrong and it reads the table in full. Writes that bypass the scripts (a plain
HINCRBY from redis-cli) move neither: the scrub finds them. At most once per ARGV[2] ms, whichever
kvgate's heartbeat comes first re-reads the next page of about ARGV[3] IDs (SSCAN of the ID index, a
cursor kept in CHECK), and every ID whose state no longer matches its row in ROWS gets a 'drift' entry in
the change log, so every kvgate applies it from the log. A full pass takes ceil(B / ARGV[3]) steps, B the
ID set's hash-table size (SSCAN COUNT walks buckets: the power of two at or above the number of IDs): a
direct edit is in every snapshot within that many intervals, one more for the log.

KEYS[1]  kvg:{epochs}:generation   KEYS[2] kvg:{epochs}:check   KEYS[3] kvg:{epochs}:ids
KEYS[4]  kvg:{epochs}:rows         KEYS[5] kvg:{epochs}:log
ARGV[1]  now (ms)     ARGV[2] scrub interval (ms)     ARGV[3] scrub page (IDs)     ARGV[4] log entries kept
ARGV[5]  the state keys' prefix (kvg:{epochs}:state:, then the ID)

Returns {generation ('' when there is none), sum, last ('0-0' before the first entry)}; {CODE.MALFORMED, why}
when refused, nothing written (lua/lib/common.lua): a key of another type, the check's sum, cursor or
rounds not what the scripts write, or a drift entry to append to a log at its last possible id (without
drift the log is only read: the kvgates go on checking their snapshots; the check's last is only returned,
kvgate reads it). Every kvgate whose heartbeat is refused says so on /healthz (docs/redis.md).
]]
local why = odd_logged_keys({{KEYS[1], 'string'}, {KEYS[3], 'set'}}, KEYS[5], KEYS[4], KEYS[2],
  {{1, 'now (ms)'}, {2, 'scrub interval (ms)'}, {3, 'scrub page'}, {4, 'log entries kept'}})
if why then
  return refuse(why)
end
local check = redis.call('HMGET', KEYS[2], 'scrub_cursor', 'scrub_at_ms', 'sum', 'last', 'scrub_rounds')
if check[1] and not (string.match(check[1], '^%d+$') and string.len(check[1]) < 20) then
  why = KEYS[2] .. ' field scrub_cursor is ' .. string.format('%q', check[1]) .. ', not an SSCAN cursor'
end
why = why or odd_count(KEYS[2], 'scrub_rounds', check[5], EXACT, '2^53')
if why then
  return refuse(why)
end
if tonumber(ARGV[1]) - (tonumber(check[2]) or 0) >= tonumber(ARGV[2]) then
  local page = redis.call('SSCAN', KEYS[3], check[1] or '0', 'COUNT', ARGV[3])
  local drifted = {}  -- read first: a drift entry the log cannot take is refused before any write
  for _, id in ipairs(page[2]) do
    local s = redis.pcall('HMGET', ARGV[5] .. id, 'digest', 'epoch', 'base', 'name', 'path', 'base_print',
      unpack(CANDIDATE_FIELDS))
    if s.err then
      s = {}
    end
    local cand = {unpack(s, 7, 6 + #CANDIDATE_FIELDS)}
    local row = row_hash(id, s[1], s[2], s[3], s[4], s[5], s[6], cand)
    if row ~= tonumber(redis.call('HGET', KEYS[4], id) or '0') then
      drifted[#drifted + 1] = id
    end
  end
  why = #drifted > 0 and odd_log_full(KEYS[5])
  if why then
    return refuse(why)
  end
  for _, id in ipairs(drifted) do
    log_change(ARGV[5] .. id, KEYS[5], KEYS[4], KEYS[2], id, 'drift', ARGV[4])
  end
  redis.call('HSET', KEYS[2], 'scrub_cursor', page[1], 'scrub_at_ms', ARGV[1])
  if page[1] == '0' then
    redis.call('HINCRBY', KEYS[2], 'scrub_rounds', 1)
  end
  check = redis.call('HMGET', KEYS[2], 'scrub_cursor', 'scrub_at_ms', 'sum', 'last')  -- drift moved them
end
return {redis.call('GET', KEYS[1]) or '', check[3] or '0', check[4] or '0-0'}
