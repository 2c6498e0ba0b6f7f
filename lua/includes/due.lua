-- due: the shard's due index (felix:{TAG}:due), where groups find the delayed records
-- they passed over once these fall due. Publishers add to it, groups read it, stream_trim
-- prunes it.
--
-- A sorted set of chunks. The score of a chunk is the start (ms) of its due-time bucket
-- (due times DUE_W ms wide: floor(due / DUE_W) * DUE_W); its member is the text
--   v2:K:FIRST:COUNT:LAST:ENTRIES
-- v2 the format (clients before it wrote chunks 'K:FIRST:COUNT:ENTRIES', entries 'D.DD' or
-- 'D+L.DD' counted from FIRST, joined by ';': they are still read, and never appended to;
-- those clients cannot read a v2 chunk as theirs, so they cannot append to one either), K
-- the chunk's number in its bucket (6 digits, so that the highest sorts last), FIRST the
-- offset the entries count from, COUNT the records of the chunk, LAST the last offset an
-- entry holds, and ENTRIES its entries one after the other, each 'G.DD' (one record) or
-- 'G+L.DD' (L records, all due then: a delayed batch). The entry's first record is G
-- offsets after the one that follows the previous entry's last record (the first entry:
-- G after FIRST), and G is left out when 0, as it is for records published one after the
-- other; DD is the due time less the bucket's start, always two digits (00..99). So
-- '.07.12' after FIRST 120 holds 120 due at score + 7 and 121 at score + 12, and '3+100.40'
-- after them the 100 records 125..224 due at score + 40. A publish appends to the highest
-- chunk of its bucket while that stays under DUE_CAP bytes, else starts the next. A record
-- costs about 3 bytes of a chunk instead of a sorted-set member of its own; reading a due
-- time means reading its bucket's chunks.

local DUE_W = 100
local DUE_CAP = 480

-- The start of the bucket of due time t (ms).
local function due_bucket(t)
  return t - t % DUE_W
end

-- The highest chunk of the bucket starting at bs: member, K, FIRST, COUNT, LAST and
-- ENTRIES, or nil when the bucket has none; for a chunk of the format before v2, K alone
-- (the publish starts the next chunk). A member that is no chunk (written by hand) fails
-- (WRONGTYPE) before anything is written.
local function due_top(key, bs)
  local bs_s = fmt(bs)
  local top = redis.call('ZRANGE', key, bs_s, bs_s, 'BYSCORE', 'REV', 'LIMIT', '0', '1')[1]
  if not top then return nil end
  local k, f, c, l, rest = s_match(top, '^v2:(%d+):(%d+):(%d+):(%d+):(.*)$')
  if k then
    return {member = top, k = tonumber(k), first = tonumber(f), count = tonumber(c), last = tonumber(l),
            entries = rest}
  end
  k = s_match(top, '^(%d+):%d+:%d+:')
  if not k then fail('WRONGTYPE', 'member ' .. s_sub(top, 1, 40) .. ' of ' .. key .. ' is not a due index chunk') end
  return {k = tonumber(k)}
end

-- The COUNT of chunk member m (either format), or 0 for a member that is no chunk.
local function due_chunk_count(m)
  return tonumber(s_match(m, '^v2:%d+:%d+:(%d+):%d+:') or s_match(m, '^%d+:%d+:(%d+):')) or 0
end

-- Adds the count records first.. first + count - 1, all due at due (ms), to the index;
-- top is due_top's answer for due's bucket, read before the caller's first write.
local function due_add(key, due, first, count, top)
  local bs = due_bucket(due)
  local tail = (count > 1 and ('+' .. fmt(count)) or '') .. s_format('.%02d', due - bs)
  local last = fmt(first + count - 1)
  local k = 0
  if top and top.member then
    local g = first - top.last - 1
    local e = (g > 0 and fmt(g) or '') .. tail
    local grown = #e + #last - #fmt(top.last) + #fmt(top.count + count) - #fmt(top.count)
    if g >= 0 and #top.member + grown <= DUE_CAP then
      redis.call('ZREM', key, top.member)
      redis.call('ZADD', key, fmt(bs), s_format('v2:%06d', top.k) .. ':' .. fmt(top.first) .. ':'
        .. fmt(top.count + count) .. ':' .. last .. ':' .. top.entries .. e)
      return
    end
  end
  if top then k = top.k + 1 end
  redis.call('ZADD', key, fmt(bs), s_format('v2:%06d', k) .. ':' .. fmt(first) .. ':' .. fmt(count) .. ':' .. last
    .. ':' .. tail)
end

-- The entries of the chunks ms (members, from bucket bs) as ranges: three parallel lists
-- (due, first offset, last offset), sorted by due time, then offset. Members that are no
-- chunk are left out.
local function due_ranges(ms, bs)
  local rd, ra, rz = {}, {}, {}
  local n, sorted, pd, pa = 0, true, -1, -1
  for _, m in ipairs(ms) do
    local f, rest = s_match(m, '^v2:%d+:(%d+):%d+:%d+:(.*)$')
    -- a chunk of the format before v2: entries counted from FIRST, joined by ';'
    local old = not f
    if old then f, rest = s_match(m, '^%d+:(%d+):%d+:(.*)$') end
    if f then
      local at = tonumber(f)  -- the offset the next entry's gap counts from
      for g, l, dd in string.gmatch(rest, old and '(%d+)%+?(%d*)%.(%d+)' or '(%d*)%+?(%d*)%.(%d%d)') do
        local a, t = at + (tonumber(g) or 0), bs + tonumber(dd)
        if old then a = tonumber(f) + tonumber(g) end
        at = a + (tonumber(l) or 1)
        n = n + 1
        rd[n], ra[n], rz[n] = t, a, at - 1
        -- (appended in publish order, the entries are often in order already)
        if t < pd or (t == pd and a < pa) then sorted = false end
        pd, pa = t, a
      end
    end
  end
  if n > 1 and not sorted then
    local order = {}
    for i = 1, n do order[i] = i end
    table.sort(order, function(x, y)
      if rd[x] ~= rd[y] then return rd[x] < rd[y] end
      return ra[x] < ra[y]
    end)
    local d2, a2, z2 = {}, {}, {}
    for i, j in ipairs(order) do d2[i], a2[i], z2[i] = rd[j], ra[j], rz[j] end
    rd, ra, rz = d2, a2, z2
  end
  return rd, ra, rz
end

-- The ranges of the bucket starting at bs (all its chunks), as due_ranges gives them.
local function due_bucket_ranges(key, bs)
  local bs_s = fmt(bs)
  return due_ranges(redis.call('ZRANGEBYSCORE', key, bs_s, bs_s), bs)
end

-- The start of the first non-empty bucket at or after from (ms) and at or before to (a
-- number or '+inf'), or nil. (A member scored off a bucket's start, written by hand,
-- stands for its bucket: the bucket is read whole, never skipped.)
local function due_next_bucket(key, from, to)
  local r = redis.call('ZRANGEBYSCORE', key, fmt(from), to, 'WITHSCORES', 'LIMIT', '0', '1')
  if #r == 0 then return nil end
  return due_bucket(tonumber(r[2]))
end

-- True when the index holds record off with due time t. cache: a table kept for one
-- call (bucket start -> its ranges), so that a scan passing over many records reads each
-- bucket once.
local function due_holds(key, off, t, cache)
  local bs = due_bucket(t)
  local b = cache[bs]
  if not b then
    local rd, ra, rz = due_bucket_ranges(key, bs)
    b = {rd, ra, rz}
    cache[bs] = b
  end
  -- the ranges are sorted by due time, then first offset, and never share an offset:
  -- the last one at or before (t, off) is the only one that can hold it
  local rd, ra, rz = b[1], b[2], b[3]
  local lo, hi = 1, #rd
  local at = 0
  while lo <= hi do
    local mid = math.floor((lo + hi) / 2)
    if rd[mid] < t or (rd[mid] == t and ra[mid] <= off) then
      at, lo = mid, mid + 1
    else
      hi = mid - 1
    end
  end
  return at > 0 and rd[at] == t and ra[at] <= off and off <= rz[at]
end

-- The earliest due time after t (ms) of an entry of the index, or nil: from the bucket of
-- t on, usually one command (a page of chunks; a bucket's start is at most its due times,
-- so the buckets after the one holding the answer are not read).
local function due_after(key, t)
  local from = fmt(due_bucket(t))
  local best = nil
  for _ = 1, 64 do
    local got = redis.call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES', 'LIMIT', '0', '8')
    local i, n = 1, #got
    if n == 0 then return best end
    while i <= n do
      local score = got[i + 1]
      if best and tonumber(score) > best then return best end
      local j, ms = i, {}
      while j <= n and got[j + 1] == score do
        ms[#ms + 1] = got[j]
        j = j + 2
      end
      if j > n and n == 16 then
        -- the page ends inside this bucket: all of it
        ms = redis.call('ZRANGEBYSCORE', key, score, score)
      end
      local rd = due_ranges(ms, tonumber(score))
      for k = 1, #rd do
        if rd[k] > t and (not best or rd[k] < best) then best = rd[k] end
      end
      i = j
    end
    if n < 16 then return best end
    from = '(' .. got[n]
  end
  return best
end

-- The records of the index due after t (ms): COUNT of the chunks of later buckets, the
-- entries of t's bucket one by one.
local function due_count_after(key, t)
  local bs = due_bucket(t)
  local n = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', key, '(' .. fmt(bs), '+inf')) do
    n = n + due_chunk_count(m)
  end
  local rd, ra, rz = due_bucket_ranges(key, bs)
  for i = 1, #rd do
    if rd[i] > t then n = n + rz[i] - ra[i] + 1 end
  end
  return n
end

-- Calls fn(due, first, last) for every range of the index with a due time in (from, to]
-- (ms), bucket by bucket in due order.
local function due_each(key, from, to, fn)
  local bs = due_bucket(from)
  while true do
    local b = due_next_bucket(key, bs, fmt(to))
    if not b then return end
    local rd, ra, rz = due_bucket_ranges(key, b)
    for i = 1, #rd do
      if rd[i] > from and rd[i] <= to then fn(rd[i], ra[i], rz[i]) end
    end
    bs = b + DUE_W
  end
end

-- The latest due time of the index, or nil.
local function due_latest(key)
  local last = redis.call('ZRANGE', key, '+inf', '-inf', 'BYSCORE', 'REV', 'LIMIT', '0', '1', 'WITHSCORES')
  if #last == 0 then return nil end
  local rd = due_bucket_ranges(key, tonumber(last[2]))
  local latest = nil
  for i = 1, #rd do
    if not latest or rd[i] > latest then latest = rd[i] end
  end
  return latest
end

-- Removes the chunks of the buckets all of whose due times are at or before bound (ms);
-- returns the records they held.
local function due_prune(key, bound)
  local upto = fmt(due_bucket(bound + 1) - 1)
  local n = 0
  local gone = redis.call('ZRANGEBYSCORE', key, '-inf', upto)
  if #gone == 0 then return 0 end
  for _, m in ipairs(gone) do n = n + due_chunk_count(m) end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', upto)
  return n
end
