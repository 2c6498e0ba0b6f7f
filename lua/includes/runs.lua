-- runs: the finished records above a group's position, kept as runs (the done key and
-- the group hash's top field).

--- @include "group"

-- The finished records above the position are kept as runs of consecutive offsets that
-- never overlap nor touch (neighbours merge when a run is added) and never hold an
-- unfinished record, so there is at most one run more than there are unfinished records
-- above the position, however many records finished while one was held back; a poll's
-- cost does not grow with them. The highest run may be kept in the group hash (field
-- top, 'FIRST-LAST'; S.top_first and S.top_last, false when there is none); the others
-- are in the done key, sorted-set members FIRST (the run's first offset) scored LAST
-- (its last), all below the top run. While the position is held back (as it is
-- whenever another consumer holds a record before them), acks in order extend the top
-- run without a command.

-- The run holding offset off (> S.pos): its first and last offsets; nil when none.
local function run_holding(K, S, off)
  local top_first = S.top_first
  if top_first and off >= top_first then
    if off <= S.top_last then return top_first, S.top_last end
    return nil
  end
  if K.types.done == 'none' then return nil end
  local r = redis.call('ZRANGE', K.done, fmt(off), '+inf', 'BYSCORE', 'LIMIT', '0', '1', 'WITHSCORES')
  if #r == 0 then return nil end
  local first = tonumber(r[1])
  if first > off then return nil end
  return first, tonumber(r[2])
end

-- The member of the run in the done key that ends at offset last, or nil.
local function run_ending(K, last)
  if K.types.done == 'none' then return nil end
  local m = fmt(last)
  return redis.call('ZRANGE', K.done, m, m, 'BYSCORE')[1]
end

-- Marks the unfinished records a..b (S.pos < a) finished, merged with the runs next to
-- them. b < S.next, except for records retention trimmed before a poll handed them out
-- (skip_trimmed, before the poll moves S.next past them): nothing lies above those.
local function add_run(K, S, a, b)
  local top_first, top_last = S.top_first, S.top_last
  if top_first then
    if a == top_last + 1 then
      -- the usual case: the top run grows (nothing lies above it)
      S.top_last = b
      S.dirty = true
      return
    elseif a > top_last + 1 then
      -- a new top run; the old one goes to the done key
      redis.call('ZADD', K.done, fmt(top_last), fmt(top_first))
      K.types.done = 'zset'
      S.top_first, S.top_last = a, b
      S.dirty = true
      return
    elseif b + 1 == top_first then
      -- just below the top run: they merge, and with the run before, if any
      local before = run_ending(K, a - 1)
      if before then
        redis.call('ZREM', K.done, before)
        a = tonumber(before)
      end
      S.top_first = a
      S.dirty = true
      return
    end
  end
  -- further below the top run, or there is none
  local before = run_ending(K, a - 1)
  local first, last = before or fmt(a), b
  if b + 1 < S.next and K.types.done ~= 'none' then
    local after = fmt(b + 1)
    local after_last = redis.call('ZSCORE', K.done, after)
    if after_last then
      last = tonumber(after_last)
      redis.call('ZREM', K.done, after)
    end
  end
  if not top_first and last == S.next - 1 then
    -- nothing can lie above a run that reaches the last delivered record: the top run
    if before then redis.call('ZREM', K.done, before) end
    S.top_first, S.top_last = tonumber(first), last
    S.dirty = true
    return
  end
  redis.call('ZADD', K.done, fmt(last), first)
  K.types.done = 'zset'
end

-- Moves S.pos over the run of finished records starting at it, if any (at most one
-- command; runs are maximal, so one run is all there can be).
local function advance_done(K, S)
  if S.top_first == S.pos then
    S.pos = S.top_last + 1
    S.top_first, S.top_last = false, false
    S.dirty = true
    return
  end
  if K.types.done == 'none' then return end
  local m = fmt(S.pos)
  local last = redis.call('ZSCORE', K.done, m)
  if not last then return end
  redis.call('ZREM', K.done, m)
  S.pos = tonumber(last) + 1
  S.dirty = true
end

-- Makes finished record off (> S.pos) unfinished again (a redrive): its run is split.
local function unfinish_above(K, S, off)
  local first, last = run_holding(K, S, off)
  if not first then return end
  if first == S.top_first then
    -- the part above off stays the top run; the part below goes to the done key
    if last > off then
      S.top_first = off + 1
      if first < off then
        redis.call('ZADD', K.done, fmt(off - 1), fmt(first))
        K.types.done = 'zset'
      end
    elseif first < off then
      S.top_last = off - 1
    else
      S.top_first, S.top_last = false, false
    end
    S.dirty = true
    return
  end
  redis.call('ZREM', K.done, fmt(first))
  if first < off then redis.call('ZADD', K.done, fmt(off - 1), fmt(first)) end
  if last > off then redis.call('ZADD', K.done, fmt(last), fmt(off + 1)) end
end

-- Marks offset off finished for the position: advance over a contiguous run, or
-- remember it above the position, or (below the position) drop its redrive mark.
local function mark_done(K, S, off)
  if off < S.pos then
    redis.call('ZREM', K.redo, fmt(off))
  elseif off == S.pos then
    S.pos = off + 1
    advance_done(K, S)
    S.dirty = true
  else
    add_run(K, S, off, off)
  end
end

-- True when a delivered record (off < S.next) is finished.
local function is_finished(K, S, m, off)
  if off < S.pos then return redis.call('ZSCORE', K.redo, m) == false end
  return run_holding(K, S, off) ~= nil
end

-- Marks the records [a, b], all at or above the position, finished: when the run starts
-- at the position (nothing unfinished before it) the position jumps over it, else the
-- run is remembered above the position.
local function mark_run_done(K, S, a, b)
  if a == S.pos then
    S.pos = b + 1
    advance_done(K, S)
    S.dirty = true
  else
    add_run(K, S, a, b)
  end
end

-- Records in [a, b] that retention trimmed before they were delivered: counted, finished.
local function skip_trimmed(K, S, a, b)
  if a >= S.pos then
    mark_run_done(K, S, a, b)
  else
    for off = a, b do mark_done(K, S, off) end
  end
  S.trimmed = S.trimmed + (b - a + 1)
  S.dirty = true
end
