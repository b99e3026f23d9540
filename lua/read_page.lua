--[[
read_page: one page of a full read of the epoch table: SSCAN the ID index from a cursor, and each ID's
state hash, in one bounded reply (a JSON document decoded once, not one reply per ID to parse).
Read-only. Needs lua/lib/common.lua prepended (kvgate does; `kvgate script read_page` prints both).

KEYS[1]  kvg:{epochs}:ids
ARGV[1]  cursor ('0' to start)    ARGV[2] IDs a page (SSCAN COUNT)
ARGV[3]  the state keys' prefix (kvg:{epochs}:state:, then the ID)

Returns {next cursor ('0': the last page), JSON [ [ID, {field: value}], ... ]} (IDs without a state hash
are left out; SSCAN may return an ID on two pages); {CODE.MALFORMED, why} when refused (lua/lib/common.lua).
]]
local why = odd_args({{1, 'cursor'}, {2, 'IDs a page'}}) or odd_type(KEYS[1], 'set')
if why then
  return refuse(why)
end
local page = redis.call('SSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local rows = {}
for _, id in ipairs(page[2]) do
  local fields = redis.pcall('HGETALL', ARGV[3] .. id)
  if not fields.err and #fields > 0 then
    local state = {}
    for i = 1, #fields, 2 do
      state[fields[i]] = fields[i + 1]
    end
    rows[#rows + 1] = {id, state}
  end
end
if #rows == 0 then
  return {page[1], '[]'}
end
return {page[1], cjson.encode(rows)}
