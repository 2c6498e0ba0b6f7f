-- group_ack: finish records: acked records leave no group state behind and the position
-- advances over any contiguous run of finished records. Idempotent: acking a finished
-- record changes nothing and says so; acking a stale claim whose record is still
-- unfinished (owed or in flight under a newer lease) finishes it.
--
-- KEYS[1] meta       hash: shard settings, tail (next offset), first (first offset kept)
-- KEYS[2] log        stream: the records, entry ID OFFSET-PUBLISHMS
-- KEYS[3] group      hash: vt (ms), max (attempts), pos, next, wseq, cons, trimmed, created
-- KEYS[4] lease      zset: in-flight offsets, score = lease expiry (ms)
-- KEYS[5] owed       zset: offsets waiting for redelivery, score = due time (ms)
-- KEYS[6] attempts   hash: offset -> deliveries so far, for unfinished delivered records
-- KEYS[7] done       set: finished offsets above the position
-- KEYS[8] redo       zset: redriven offsets below the position, score = offset
-- KEYS[9] dead       hash: offset -> "ATTEMPTS|MS|REASON" dead-letter pointers
-- KEYS[10] owner     hash: offset -> consumer name holding the lease (named consumers)
-- KEYS[11] byowner   zset: "CONSUMER|OFFSET" members, score 0, for reclaim
-- KEYS[12] wake      stream: one entry per wake-up, long-polling consumers block on it
-- ARGV[1..] offsets   1..10000 offsets (integers) of delivered records
--
-- Role: group.consume, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:g:GROUP:consume, derived from KEYS[3]; never passed nor accessed.
-- Returns: one status per offset: 1 acked now, 0 already finished.
-- Errors: FELIX_NOPERM (no group.consume role), FELIX_NOT_FOUND (stream, shard, group; an offset never delivered), FELIX_INVALID,
-- FELIX_WRONGTYPE. All offsets are checked before anything is written.
--- @include "group"
require_group_role('group.consume')
if #ARGV < 1 or #ARGV > 10000 then fail('INVALID', 'ack takes 1 to 10000 offsets') end
local ms = {}
for i = 1, #ARGV do
  local v = ARGV[i]
  -- members are canonical decimal strings; anything else takes the checking path
  if #v > 15 or not s_find(v, '^%d+$') or (#v > 1 and s_byte(v, 1) == 48) then
    v = fmt(int_arg(v, 'offset', 0, 2 ^ 52))
  end
  ms[i] = v
end
local K = group_keys()
local S = load_group(K)
local uniq, first, offs = {}, {}, {}
local ascending, last = true, -1
for i, m in ipairs(ms) do
  local off = tonumber(m)
  if off >= S.next then
    fail('NOT_FOUND', 'record ' .. m .. ' has not been delivered to this group (next is ' .. fmt(S.next) .. ')')
  end
  if not first[m] then
    first[m] = i
    uniq[#uniq + 1] = m
    offs[#offs + 1] = off
    if off < last then ascending = false end
    last = off
  end
end
-- unfinished = in flight (lease) or owed; anything else delivered is finished already
local unfinished = uniq
local removed = 0
if K.types.lease ~= 'none' then
  removed = call_many('ZREM', K.lease, uniq)
  S.unleased = removed > 0
end
if removed < #uniq then
  -- some were owed or finished: tell them apart. The done set and the redo marks are
  -- untouched so far, so is_finished still answers for the state before this ack.
  unfinished = {}
  local owed, owed_scores = {}, {}
  if K.types.owed ~= 'none' then owed_scores = call_many('ZMSCORE', K.owed, uniq) end
  for j, m in ipairs(uniq) do
    if owed_scores[j] then
      owed[#owed + 1] = m
      unfinished[#unfinished + 1] = m
    elseif not is_finished(K, S, m, tonumber(m)) then
      unfinished[#unfinished + 1] = m
    else
      first[m] = false
    end
  end
  if #owed > 0 then call_many('ZREM', K.owed, owed) end
end
local out = {}
for i, m in ipairs(ms) do out[i] = first[m] == i and 1 or 0 end
if #unfinished > 0 then
  -- offsets in order (acks of a poll's records usually are) need no sort
  if unfinished ~= uniq then offs = nil elseif not ascending then table.sort(offs) end
  finish_many(K, S, unfinished, offs)
end
save_group(K, S)
return out
