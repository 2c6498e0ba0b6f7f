-- stream_create: create one shard of a stream, or confirm it exists with the same settings.
-- Safe to run twice: a shard that exists with identical settings is left as it is.
--
-- KEYS[1] meta         hash: tail (next offset) and first offset (and the producers'
--                      states, lua/publish.lua); publishers write it
-- KEYS[2] log          stream: the records, entry ID OFFSET-PUBLISHMS
-- KEYS[3] conf         hash: the shard's settings (ARGV 1-9, 11, 12 by name) and created
--                      (ms); only stream.admin writes it
-- ARGV[1] kind         'queue' or 'stream'
-- ARGV[2] shards       integer 1..1024, shard count of the stream
-- ARGV[3] shard        integer 0..shards-1, this shard
-- ARGV[4] replication  integer 1..16, copies including the primary
-- ARGV[5] consistency  'leader', 'quorum' or 'all'
-- ARGV[6] max_len      integer >= 0, retention: records kept per shard (0: unbounded)
-- ARGV[7] max_age      integer >= 0, retention: seconds a record is kept (0: unbounded)
-- ARGV[8] max_payload  integer 1..536870912, bytes
-- ARGV[9] name         'tenant/namespace/stream', for display
-- ARGV[10] check       '1': validate only and write nothing (the caller checks every
--                      shard before it writes any, and learns which it would create);
--                      '0': create
-- ARGV[11] mode        retention mode: 'safe' (a queue never trims what a group has not
--                      finished) or 'bounded' (limits win; groups count what they lose)
-- ARGV[12] spread      integer 0..1024: the shard count the shards' hash tags are spread
--                      for (docs/keys.md), 0 for plain tags; a shard made before this
--                      setting existed holds none, which counts as 0
--
-- Role: stream.admin, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:admin, derived from KEYS[1]; never passed nor accessed.
-- Returns: 1 when created (check=1: when it would be created), 0 when it existed with the
-- same settings.
-- Errors: FELIX_NOPERM (no stream.admin role), FELIX_INVALID (bad argument, keys not the shard's meta, log and
-- conf), FELIX_STREAM_EXISTS (exists with other
-- settings; names the first that differs), FELIX_WRONGTYPE.
--- @include "acl"
require_stream_role('stream.admin', nil, SHARD_KEYS_PUBLISH)
local kind, consistency = ARGV[1], ARGV[5]
if kind ~= 'queue' and kind ~= 'stream' then fail('INVALID', "kind must be 'queue' or 'stream'") end
local shards = int_arg(ARGV[2], 'shards', 1, 1024)
local shard = int_arg(ARGV[3], 'shard', 0, shards - 1)
local replication = int_arg(ARGV[4], 'replication', 1, 16)
if consistency ~= 'leader' and consistency ~= 'quorum' and consistency ~= 'all' then
  fail('INVALID', "consistency must be 'leader', 'quorum' or 'all'")
end
int_arg(ARGV[6], 'retention_max_len', 0, 2 ^ 52)
int_arg(ARGV[7], 'retention_max_age', 0, 2 ^ 52)
int_arg(ARGV[8], 'max_payload', 1, 536870912)
local mode = ARGV[11]
if mode ~= 'safe' and mode ~= 'bounded' then fail('INVALID', "retention mode must be 'safe' or 'bounded'") end
local spread = int_arg(ARGV[12], 'spread', 0, 1024)
expect_type(KEYS[1], 'hash')
expect_type(KEYS[2], 'stream')
expect_type(KEYS[3], 'hash')
local settings = {'kind', kind, 'shards', ARGV[2], 'shard', ARGV[3], 'replication', ARGV[4],
  'consistency', consistency, 'max_len', ARGV[6], 'max_age', ARGV[7], 'max_payload', ARGV[8],
  'name', ARGV[9], 'mode', mode, 'spread', ARGV[12]}
-- the settings live in conf, out of publishers' reach
if redis.call('EXISTS', KEYS[3]) == 1 then
  for i = 1, #settings, 2 do
    local have = redis.call('HGET', KEYS[3], settings[i])
    if have == false and settings[i] == 'spread' then have = '0' end
    if have ~= settings[i + 1] then
      fail('STREAM_EXISTS', 'stream exists with ' .. settings[i] .. '=' .. tostring(have)
        .. ', not ' .. settings[i + 1])
    end
  end
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  fail('WRONGTYPE', 'key ' .. KEYS[1] .. ' or ' .. KEYS[2] .. ' exists without stream settings (' .. KEYS[3]
    .. '); another application wrote it, or a publisher wrote meta by hand')
end
if spread ~= 0 and spread ~= shards then fail('INVALID', 'spread must be 0 or the shard count') end
if ARGV[10] == '1' then return 1 end
redis.call('HSET', KEYS[3], 'created', fmt(now_ms()), unpack(settings))
redis.call('HSET', KEYS[1], 'tail', '0', 'first', '0')
return 1
