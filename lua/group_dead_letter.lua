-- group_dead_letter: make a held record a dead letter at once (a pointer: attempts,
-- time, reason; the record stays in the log). The group moves past it. Needs the
-- current claim.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (lua/includes/group.lua)
-- ARGV[1] offset      integer, the record
-- ARGV[2] attempts    integer >= 1, the claim's attempts
-- ARGV[3] reason      text, at most 4096 bytes
--
-- Role: group.consume, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:consume, derived from KEYS[3]; never passed nor accessed.
-- Returns: 1.
-- Errors: FELIX_NOPERM (no group.consume role), FELIX_STALE_CLAIM, FELIX_NOT_FOUND, FELIX_INVALID, FELIX_WRONGTYPE.
--- @include "group"
--- @include "dead_letters"
require_group_role('group.consume')
local off = int_arg(ARGV[1], 'offset', 0, 2 ^ 52)
local attempts = int_arg(ARGV[2], 'attempts', 1, 2 ^ 52)
local reason = ARGV[3] or ''
if #reason > 4096 then fail('INVALID', 'reason is ' .. fmt(#reason) .. ' bytes; at most 4096') end
local K = group_role_keys()
local S = load_group(K)
local now = now_ms()
check_claim(K, S, off, attempts, now)
dead_letter(K, S, off, attempts, reason, now)
save_group(K, S)
return 1
