--[[
take_gate_turn: one kvgate process at a time gates a rollout (its lease), and it audits at most once per
interval, fleet-wide. Every worker of every kvgate asks at each of its gate's ticks; the holder's ask
renews its lease, a lease whose holder stopped asking (it died) expires and the next asker takes it. The
time of the last round is kept beside the holder, so a taken-over lease keeps the fleet's interval.
Needs lua/lib/common.lua prepended (kvgate does; `kvgate script take_gate_turn` prints both).

KEYS[1]  kvg:{ID}:gate:<candidate digest>   hash: holder (gateway id), until_ms (its lease's expiry),
                                             round_ms (when the last audit round began)
ARGV[1]  gateway id      ARGV[2] now (ms)      ARGV[3] lease time to live (ms)
ARGV[4]  interval (ms): the least time between two audit rounds of the rollout

Returns {code, holder, until_ms, round_ms}: CODE.CHANGED (this gateway holds the lease and its round is
due: round_ms is now), CODE.UNCHANGED (it holds the lease, no round due yet) or CODE.LEASED (another
gateway's live lease holds it: nothing written); {CODE.MALFORMED, why} when refused, nothing written.
]]
local numbers = {{2, 'now (ms)'}, {3, 'lease time to live (ms)'}, {4, 'interval (ms)'}}
local why = odd_args(numbers) or odd_type(KEYS[1], 'hash')
if why then
  return refuse(why)
end
local me, now, ttl, interval = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local holder = redis.call('HGET', KEYS[1], 'holder')
local held_until = stored_ms(redis.call('HGET', KEYS[1], 'until_ms')) or 0
local last_round = stored_ms(redis.call('HGET', KEYS[1], 'round_ms')) or 0
if holder and holder ~= me and held_until > now then
  return {CODE.LEASED, holder, held_until, last_round}
end
local code = CODE.UNCHANGED
if last_round == 0 or now - last_round >= interval then
  code, last_round = CODE.CHANGED, now
end
redis.call('HSET', KEYS[1], 'holder', me, 'until_ms', now + ttl, 'round_ms', last_round)
redis.call('PEXPIRE', KEYS[1], ttl + interval)
return {code, me, now + ttl, last_round}
