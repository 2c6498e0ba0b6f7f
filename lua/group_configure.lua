-- group_configure: change a group's visibility timeout, max attempts and/or rate limit on
-- one shard.
-- Leases already granted keep their expiry. A rate limit set or removed wakes the group's
-- long-polling consumers (a window they wait for may have ended). Safe to run twice.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (lua/includes/group.lua)
-- ARGV[1] vt_ms         integer 1..604800000, or '' to keep
-- ARGV[2] max_attempts  integer 1..1000000, or '' to keep
-- ARGV[3] check         '1': validate only and write nothing; '0': configure
-- ARGV[4] rate          'COUNT PER_MS' (COUNT 1..1000000 hand-outs per PER_MS 1..86400000
--                       ms), '0 0' to remove the limit, or '' (or absent) to keep
--
-- Role: group.manage, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:manage, derived from KEYS[3]; never passed nor accessed.
-- Returns: {vt_ms, max_attempts, rate ('COUNT PER_MS', or nil: none)} as now stored.
-- Errors: FELIX_NOPERM (no group.manage role), FELIX_NOT_FOUND, FELIX_INVALID, FELIX_WRONGTYPE.
--- @include "group"
require_group_role('group.manage')
local K = group_role_keys()
local vt, max
if ARGV[1] ~= '' then vt = int_arg(ARGV[1], 'visibility_timeout_ms', 1, 604800000) end
if ARGV[2] ~= '' then max = int_arg(ARGV[2], 'max_attempts', 1, 1000000) end
local rate = ARGV[4] or ''
if rate ~= '' then rate = check_rate(rate) end
local S = load_group(K)
if ARGV[3] == '1' then return {S.vt, S.max, S.rate} end
if vt then S.vt = vt; redis.call('HSET', K.group, 'vt', fmt(vt)) end
if max then S.max = max; redis.call('HSET', K.group, 'max', fmt(max)) end
if rate == false then
  redis.call('HDEL', K.group, 'rate')
  S.rate = false
elseif rate ~= '' and rate ~= S.rate then
  -- a new limit starts with a new window
  redis.call('HSET', K.group, 'rate', rate)
  S.rate = rate
end
if rate ~= '' then
  -- pollers waiting for the old limit's window to end look again now
  wake(K, S)
  save_group(K, S)
end
return {S.vt, S.max, S.rate}
