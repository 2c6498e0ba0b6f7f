-- schedule_delete: remove one recurring schedule from a shard. A tick still holding its due
-- times publishes none of them.
--
-- KEYS[1] sched      zset: schedule name -> next due time (ms since the epoch)
-- KEYS[2] schedules  hash: the schedules' specs, states, payloads, keys and headers
--                    (lua/includes/schedules.lua)
-- ARGV[1] name       the schedule's name
--
-- Role: stream.publish or stream.admin, checked first (lua/includes/acl.lua).
-- Returns: 1 when the shard held the schedule, else 0 (nothing changed).
-- Errors: FELIX_NOPERM (neither role), FELIX_INVALID (bad name; keys not the shard's sched
-- and schedules), FELIX_WRONGTYPE.
--- @include "schedules"
require_stream_role('stream.publish', 'stream.admin', SCHED_KEYS)
local name = check_schedule_name(ARGV[1])
local sched, schedules = KEYS[1], KEYS[2]
local there = typed_call('hash', 'HEXISTS', schedules, name .. '|s')
local scored = typed_call('zset', 'ZSCORE', sched, name)
if there == 0 and not scored then return 0 end
redis.call('HDEL', schedules, name, name .. '|s', name .. '|p', name .. '|k', name .. '|h')
redis.call('ZREM', sched, name)
return 1
