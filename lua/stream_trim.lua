-- stream_trim: apply a shard's retention (records kept, age). For a queue in the default
-- 'safe' mode, never trims a record that any group has not finished: the cut stops at
-- the smallest group position. In 'bounded' mode (and for kind 'stream') it trims what
-- the limits say; groups then count the records they lost (group 'trimmed') and never
-- skip them silently. The caller lists the shard's groups and passes two keys of each;
-- the script refuses if that list is out of date.
--
-- KEYS[1] meta       hash: tail, first
-- KEYS[2] log        stream: the records, entry ID OFFSET-PUBLISHMS
-- KEYS[3] groups     set: names of the groups on this shard
-- KEYS[4] conf       hash: settings (kind, mode, max_len, max_age)
-- KEYS[5..] group keys, 2 per group: the group hash (pos) and its redo zset, exactly
--                    the keys of the group ARGV names (a name whose group hash does
--                    not exist holds nothing back)
-- KEYS[last] due     zset (optional, after the group keys): the shard's due index; its
--                    chunks whose records are all due at or before every group's due
--                    cursor (and now) are pruned: no group will look at them again (a
--                    group standing inside a due time still needs that due time)
-- ARGV[1] count      integer, number of groups passed
-- ARGV[2..] names    the group names, in the order of their keys
--
-- Role: stream.publish or stream.admin, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:publish or PREFIXcap:{TAG}:admin, derived from KEYS[1]; never passed nor accessed.
-- Returns: {records trimmed now, first offset kept, records pruned from the due index}.
-- Errors: FELIX_NOPERM (no stream.publish or stream.admin role), FELIX_NOT_FOUND (no such stream or shard), FELIX_INVALID (arguments do not
-- match, or a key is not the one the shard and the group names imply), FELIX_CONFLICT (the group list changed: read again and retry), FELIX_WRONGTYPE.
--- @include "shard_groups"
--- @include "due"
require_stream_role('stream.publish', 'stream.admin')
local count, extra = shard_groups(2, {'due'})
local due = extra.due
for g = 0, count - 1 do
  expect_type(KEYS[5 + 2 * g], 'hash')
  expect_type(KEYS[6 + 2 * g], 'zset')
end
local c = redis.call('HMGET', KEYS[4], 'max_len', 'max_age', 'kind', 'mode')
if not c[3] then fail('NOT_FOUND', 'stream (or shard) does not exist') end
-- the offsets as the log has them (a publisher may write meta by hand)
local log_end = log_tail(KEYS[2])
local m = {log_end, log_first(KEYS[2], log_end), c[1], c[2], c[3], c[4]}
if redis.call('SCARD', KEYS[3]) ~= count then fail('CONFLICT', 'the groups changed; retry') end
for i = 1, count do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i + 1]) == 0 then fail('CONFLICT', 'the groups changed; retry') end
end
local tail, first = tonumber(m[1]), tonumber(m[2])
local max_len, max_age = tonumber(m[3]), tonumber(m[4])
local cut = first
if max_len > 0 and tail - max_len > cut then cut = tail - max_len end
if max_age > 0 then
  -- records are in publish-time order: walk from the oldest kept, at most 1000 per call
  local oldest_kept = now_ms() - max_age * 1000
  local entries = redis.call('XRANGE', KEYS[2], fmt(cut), '+', 'COUNT', 1000)
  local age_cut = cut
  for _, e in ipairs(entries) do
    local off, ms = parse_id(e[1])
    if tonumber(ms) >= oldest_kept then break end
    age_cut = off + 1
  end
  if age_cut > cut then cut = age_cut end
end
if m[5] == 'queue' and m[6] ~= 'bounded' then
  for g = 0, count - 1 do
    local pos = tonumber(redis.call('HGET', KEYS[5 + 2 * g], 'pos'))
    local redo = redis.call('ZRANGE', KEYS[6 + 2 * g], 0, 0, 'WITHSCORES')
    if pos and #redo > 0 and tonumber(redo[2]) < pos then pos = tonumber(redo[2]) end
    if pos and pos < cut then cut = pos end
  end
end
local pruned = 0
if due then
  local bound = now_ms()
  for g = 0, count - 1 do
    local d = redis.call('HMGET', KEYS[5 + 2 * g], 'dly', 'name')
    -- a group hash that does not exist holds nothing back; 'DCUR BASE SK[ DOFF]':
    -- standing inside a due time (DOFF), the entries due at DCUR are still needed
    if d[2] then
      local dcur, doff = s_match(d[1] or '', '^(%d+) %d+ %d+ ?(%d*)')
      dcur = tonumber(dcur) or 0
      if doff and doff ~= '' then dcur = dcur - 1 end
      bound = math.min(bound, dcur)
    end
  end
  if bound > 0 then pruned = due_prune(due, bound) end
end
if cut <= first then return {0, first, pruned} end
redis.call('XTRIM', KEYS[2], 'MINID', fmt(cut))
redis.call('HSET', KEYS[1], 'first', fmt(cut))
return {cut - first, cut, pruned}
