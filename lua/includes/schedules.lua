-- schedules: the recurring schedules of one shard (docs/schedules.md). Two keys hold them:
-- 'sched', a zset of schedule name -> its next due time (ms since the epoch, server clock;
-- +inf for a cron expression that has no next time), and 'schedules', a hash with five
-- fields per schedule NAME:
--   NAME     the spec as JSON (cron, every, timezone, key, headers), for clients only
--   NAME|s   the state 'V A LAST OFFSET': V the version (1 up, a replace adds 1), A the
--            time it was set (ms; no due time at or before A fires), LAST the last due
--            time published (ms) and OFFSET its record's offset ('-' and '-' before)
--   NAME|p   the payload
--   NAME|k   the record key (absent: none)
--   NAME|h   the record headers as publish takes them (absent: none)
-- A schedule's records go to the shard of its key (or of its name), so publishing a due
-- time touches one shard's keys only.

--- @include "acl"

-- Key lists of the schedule scripts, by role name (require_stream_role).
local SCHED_KEYS = {'sched', 'schedules'}
local SCHED_KEYS_SET = {'sched', 'schedules', 'conf'}
local SCHED_KEYS_FIRE = {'sched', 'schedules', 'meta', 'log', 'conf'}

-- Fails with INVALID unless name is a schedule name: 1..64 characters [A-Za-z0-9_.-],
-- starting with a letter or digit (so 'NAME|x' fields never collide).
local function check_schedule_name(name)
  if type(name) ~= 'string' or #name < 1 or #name > 64 or not s_match(name, '^[A-Za-z0-9][A-Za-z0-9_.-]*$') then
    fail('INVALID', 'bad schedule name ' .. s_sub(tostring(name), 1, 70))
  end
  return name
end

-- V, A, LAST, OFFSET of a state string (LAST and OFFSET false before the first publish);
-- nil for anything else (a state written by hand counts as none).
local function schedule_state(s)
  if not s then return nil end
  local v, a, last, off = s_match(s, '^(%d+) (%d+) ([%d-]+) ([%d-]+)$')
  if not v then return nil end
  return tonumber(v), tonumber(a), tonumber(last) or false, tonumber(off) or false
end
