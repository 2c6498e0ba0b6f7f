-- dead_letters: dead-lettering a record, and the dead letters a redrive or discard acts on.

--- @include "acks"

-- Records a dead letter (a pointer: attempts, time, reason) and finishes the record.
local function dead_letter(K, S, off, attempts, reason, now)
  redis.call('HSET', K.dead, fmt(off), fmt(attempts) .. '|' .. fmt(now) .. '|' .. reason)
  finish(K, S, off)
end

-- Dead letters read per call of a redrive or discard of them all (an HSCAN COUNT).
local DEAD_SCAN = 1000

-- True when the log holds record m (a member string): retention has not trimmed it.
local function in_log(K, m)
  return #redis.call('XRANGE', K.log, m, m, 'COUNT', 1) > 0
end

-- The dead letters a redrive or discard (verb) acts on, as members, and the next HSCAN
-- cursor ('0' when done), by ARGV[1] mode: 'list', the offsets ARGV[3..], each checked
-- to be a dead letter (and, with logged, to be in the log) before anything is written;
-- 'all', the next chunk of them from cursor ARGV[2] (with logged, those in the log).
local function dead_targets(K, verb, logged)
  local mode, targets, cursor = ARGV[1], {}, '0'
  if mode == 'list' then
    if #ARGV < 3 or #ARGV > 10002 then fail('INVALID', verb .. ' takes 1 to 10000 offsets') end
    for i = 3, #ARGV do
      local m = fmt(int_arg(ARGV[i], 'offset', 0, 2 ^ 52))
      if redis.call('HEXISTS', K.dead, m) == 0 then
        fail('NOT_FOUND', 'record ' .. m .. ' is not a dead letter of this group')
      end
      if logged and not in_log(K, m) then
        fail('NOT_FOUND', 'record ' .. m .. ' was trimmed from the log; discard it instead')
      end
      targets[#targets + 1] = m
    end
  elseif mode == 'all' then
    local scan = redis.call('HSCAN', K.dead, ARGV[2], 'COUNT', DEAD_SCAN)
    cursor = scan[1]
    for i = 1, #scan[2], 2 do
      local m = scan[2][i]
      -- trimmed records cannot be redelivered: they stay dead letters
      if not logged or in_log(K, m) then targets[#targets + 1] = m end
    end
  else
    fail('INVALID', "mode must be 'all' or 'list'")
  end
  return targets, cursor
end
