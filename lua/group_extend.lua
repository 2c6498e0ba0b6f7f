-- group_extend: set a held lease to expire by_ms from now (server time). Needs the
-- current claim. Safe to run twice.
--
-- KEYS[1]..KEYS[13]: the group key block (lua/includes/group.lua says what each key holds)
-- KEYS[14] due        zset: the shard's due index (lua/includes/group.lua)
-- ARGV[1] offset      integer, the record
-- ARGV[2] attempts    integer >= 1, the claim's attempts
-- ARGV[3] by_ms       integer 1..604800000, or '' for the group's visibility timeout
--
-- Role: group.consume, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:consume, derived from KEYS[3]; never passed nor accessed.
-- Returns: the new lease expiry, ms since the epoch.
-- Errors: FELIX_NOPERM (no group.consume role), FELIX_STALE_CLAIM, FELIX_NOT_FOUND, FELIX_INVALID, FELIX_WRONGTYPE.
--- @include "group"
--- @include "acks"
require_group_role('group.consume')
local off = int_arg(ARGV[1], 'offset', 0, 2 ^ 52)
local attempts = int_arg(ARGV[2], 'attempts', 1, 2 ^ 52)
local by
if ARGV[3] ~= '' then by = int_arg(ARGV[3], 'extend by_ms', 1, 604800000) end
local K = group_role_keys()
local S = load_group(K)
local now = now_ms()
local m, lease = check_claim(K, S, off, attempts, now)
local expiry = now + (by or S.vt)
-- the record leaves its lease (shared with the records polled with it) for one of its own
unlease(K, {off}, lease)
add_leases(K, {m}, {m}, fmt(expiry))
-- a shorter lease may now fall due before a long-poller's timer
wake(K, S)
save_group(K, S)
return expiry
