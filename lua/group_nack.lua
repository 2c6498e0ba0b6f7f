-- group_nack: hand a record back: owed again after delay_ms, or a dead letter when its
-- deliveries reached max_attempts. Needs the current claim.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (lua/includes/group.lua)
-- ARGV[1] offset      integer, the record
-- ARGV[2] attempts    integer >= 1, the claim's attempts
-- ARGV[3] delay_ms    integer 0..604800000, redeliver no sooner than this
-- ARGV[4] release     '1' releases a record its consumer fetched ahead and never handed to
--                     its caller (prefetch): the delivery is not counted (the next one says
--                     the same attempts, the attempts entry goes back by one) and it never
--                     becomes a dead letter; '' (or absent): a nack
--
-- Role: group.consume, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:consume, derived from KEYS[3]; never passed nor accessed.
-- Returns: 1 when owed again, 2 when it became a dead letter (never for a release).
-- Errors: FELIX_NOPERM (no group.consume role), FELIX_STALE_CLAIM (lease lapsed, redelivered or finished), FELIX_NOT_FOUND,
-- FELIX_INVALID (negative or huge delay, bad number, release not '1' or ''), FELIX_WRONGTYPE.
--- @include "group"
--- @include "dead_letters"
require_group_role('group.consume')
local off = int_arg(ARGV[1], 'offset', 0, 2 ^ 52)
local attempts = int_arg(ARGV[2], 'attempts', 1, 2 ^ 52)
local delay = int_arg(ARGV[3], 'delay_ms', 0, 604800000)
local release = ARGV[4] or ''
if release ~= '' and release ~= '1' then fail('INVALID', "release must be '1' or empty, got " .. release) end
release = release == '1'
local K = group_role_keys()
local S = load_group(K)
local now = now_ms()
local m, lease = check_claim(K, S, off, attempts, now)
local status
if attempts >= S.max and not release then
  dead_letter(K, S, off, attempts, 'max_attempts reached: nacked', now)
  status = 2
else
  unlease(K, {off}, lease)
  release_owner(K, S, m)
  if not release then
    redis.call('HSET', K.attempts, m, attempts)
  elseif attempts > 1 then
    redis.call('HSET', K.attempts, m, attempts - 1)  -- its next delivery is this one again
  else
    redis.call('HDEL', K.attempts, m)  -- (no entry: its next delivery is its first)
  end
  redis.call('ZADD', K.owed, now + delay, m)
  wake(K, S)
  status = 1
end
save_group(K, S)
return status
