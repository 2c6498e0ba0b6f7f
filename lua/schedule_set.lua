-- schedule_set: create one recurring schedule, or replace the one of that name, on the
-- shard its records go to. Its first due time is after now: nothing fires at once. A
-- replace starts over (a new version; last published due time and offset cleared), and a
-- tick still holding the old version's due times publishes none of them.
--
-- KEYS[1] sched      zset: schedule name -> next due time (ms since the epoch; +inf: none)
-- KEYS[2] schedules  hash: per schedule NAME the fields NAME (spec JSON), NAME|s (state
--                    'V A LAST OFFSET'), NAME|p (payload), NAME|k (key), NAME|h (headers);
--                    lua/includes/schedules.lua
-- KEYS[3] conf       hash: the stream's settings (max_payload, bytes: the payload's limit;
--                    missing: no such stream or shard)
-- ARGV[1] name       1..64 characters [A-Za-z0-9_.-], starting with a letter or digit
-- ARGV[2] spec       the spec as JSON for clients (cron, every, timezone, key, headers),
--                    1..4096 bytes, starting with '{'
-- ARGV[3] every      an every-schedule's period in ms (1000..31622400000); '' for cron
-- ARGV[4] first      a cron schedule's first due time (ms since the epoch) after the server
--                    time the client read (schedule_due); '' for every (then now + every).
--                    A due time at or before now never fires: the first tick moves it on
-- ARGV[5] key        the records' key, '' for none; at most 1024 bytes
-- ARGV[6] headers    '' (none) or the records' headers as publish takes them: a JSON object
--                    of 1..64 headers, names of 1..128 characters [A-Za-z0-9._-]
-- ARGV[7] payload    the records' payload (bytes), at most the stream's max_payload
--
-- Role: stream.publish or stream.admin, checked first (lua/includes/acl.lua).
-- Returns: {first due time ms, 1 if it replaced a schedule of that name else 0}.
-- Errors: FELIX_NOPERM (neither role), FELIX_NOT_FOUND (no such stream or shard),
-- FELIX_INVALID (bad name, spec, period, first due time, key, headers or an oversize
-- payload; keys not the shard's sched, schedules and conf), FELIX_WRONGTYPE.
--- @include "schedules"
--- @include "records"
require_stream_role('stream.publish', 'stream.admin', SCHED_KEYS_SET)
local name = check_schedule_name(ARGV[1])
local spec, every_s, first_s, key, headers, payload = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
if #spec < 1 or #spec > 4096 or s_sub(spec, 1, 1) ~= '{' then
  fail('INVALID', 'the spec must be a JSON object of 1..4096 bytes')
end
local every = false
if every_s ~= '' then
  if first_s ~= '' then fail('INVALID', 'give every or a first due time, not both') end
  every = int_arg(every_s, 'every ms', 1000, 31622400000)
elseif first_s == '' then
  fail('INVALID', 'give every (ms) or, for a cron schedule, its first due time')
end
local first = first_s ~= '' and int_arg(first_s, 'first due time ms', 1, 2 ^ 52)
if #key > 1024 then fail('INVALID', 'a record key is at most 1024 bytes, got ' .. fmt(#key)) end
if headers ~= '' then check_headers(headers) end
local sched, schedules = KEYS[1], KEYS[2]
local max_payload = setting_num(typed_call('hash', 'HGET', KEYS[3], 'max_payload'))
if not max_payload then fail('NOT_FOUND', 'stream (or shard) does not exist') end
if #payload > max_payload then
  fail('INVALID', 'the payload is ' .. fmt(#payload) .. ' bytes; this stream accepts at most ' .. fmt(max_payload))
end
local old = typed_call('hash', 'HGET', schedules, name .. '|s')
typed_call('zset', 'ZSCORE', sched, name)
local version = (schedule_state(old) or 0) + 1
local now = now_ms()
if every then first = now + every end
redis.call('HSET', schedules, name, spec, name .. '|s', fmt(version) .. ' ' .. fmt(now) .. ' - -', name .. '|p', payload)
if key ~= '' then redis.call('HSET', schedules, name .. '|k', key) else redis.call('HDEL', schedules, name .. '|k') end
if headers ~= '' then
  redis.call('HSET', schedules, name .. '|h', headers)
else
  redis.call('HDEL', schedules, name .. '|h')
end
redis.call('ZADD', sched, fmt(first), name)
return {fmt(first), old and 1 or 0}
