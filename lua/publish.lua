-- publish: append one or more records to one shard, atomically, with dense offsets.
-- With a producer secret, the shard remembers the producer's last sequence and its
-- offsets in its meta hash: a re-send of that sequence returns the original offsets and
-- appends nothing.
--
-- KEYS[1] meta         hash: tail (next offset to assign), first (first offset kept); per
--                      idempotent producer the field 'producer:DIGEST' (DIGEST: the first
--                      32 hex digits of SHA1(SECRET)) = 'SEQ FIRST COUNT MS IDLE MAC' of its
--                      last publish (MS: its publish time, ms since the epoch; IDLE: ms
--                      after MS the field is kept at least; MAC: the first 16 hex digits
--                      of SHA1(SECRET .. ' ' .. the five numbers)), and 'producer_scan',
--                      the HSCAN cursor of their pruning
-- KEYS[2] log          stream: records as entry ID OFFSET-PUBLISHMS, fields p (payload),
--                      k (key), h (headers), d (delay: the due time less the publish
--                      time, ms), x (expiry, ms since the epoch), each but p only when
--                      the record has it
-- KEYS[3] conf         hash: the stream's settings (max_payload, bytes, is read here)
-- KEYS[4] due          zset (only with a delivery time): the shard's due index, chunks of
--                      the delayed records' offsets by due-time bucket (lua/includes/due.lua)
-- ARGV[1] key          record key, '' for none; at most 1024 bytes
-- ARGV[2] secret       the producer's secret, 32 to 64 characters [0-9a-f], '' for a
--                      plain publish
-- ARGV[3] sequence     integer >= 1, the producer's per-shard sequence ('0' when none)
-- ARGV[4] idle_ms      integer, milliseconds the producer's state is kept after its last
--                      publish on this shard
-- ARGV[5] deliver      '' (at once), '+MS' (MS milliseconds after the publish, server
--                      clock, 0..31622400000 = 366 days) or '@MS' (ms since the epoch, at
--                      most 366 days ahead); a due time not after the publish is at once
-- ARGV[6] expires      '' (never) or MS: the records expire MS milliseconds after the
--                      publish (1..31622400000)
-- ARGV[7] headers      '' (none) or a JSON object of 1..64 headers: names of 1..128
--                      characters [A-Za-z0-9._-], string values, 16384 bytes in all
-- ARGV[8..] payloads   1..10000 payloads (bytes)
-- Delivery time, expiry and headers apply to every record of the call. meta also gets
-- 'tlast' (the last offset of a record with any of them: groups read records at or below
-- it one by one) and, with a delivery time, 'dmax' (the latest due time in the index).
--
-- A producer is known by its secret, which only its client holds: the field is named by
-- a digest of it (anyone who may read meta sees the digest, never the secret), and the
-- state carries a MAC made with it. A state whose MAC does not match (written by hand)
-- counts as none: the publish appends. So no call can act as another producer, and a
-- forged state can at worst make a re-send append again, never drop a record.
-- The tail is trusted only as far as the log agrees: a tail that is not a number, or
-- below the log's last entry (written by hand), is replaced by the log's.
-- A producer's state is one field of the meta hash, read and written by the commands a
-- publish sends anyway (HMGET, HSET). Fields past MS + IDLE are pruned a few at a time, by
-- the publishes of producers new to the shard: an expired state left unpruned still
-- answers its producer (as if its idle time were longer), nothing else.
--
-- Role: stream.publish, checked first (lua/includes/acl.lua) on the capability key
-- PREFIXcap:{TAG}:publish, derived from KEYS[1]; never passed nor accessed.
-- Returns: {first offset, count, publish time ms (a string), 1 if a duplicate re-send else 0,
-- first offset kept in the log (a string; the client trims when the log outgrows its
-- retention)}. The two strings are passed on as Redis gave them: no number is parsed
-- or formatted for them.
-- Errors: FELIX_NOPERM (no stream.publish role), FELIX_NOT_FOUND (no such stream or shard),
-- FELIX_INVALID (oversize payload or key, bad argument, bad delivery time, expiry or
-- headers, keys not the shard's meta, log, conf and due), FELIX_SEQUENCE (sequence older
-- than the last or with a gap), FELIX_WRONGTYPE.
--- @include "acl"
--- @include "producer"
--- @include "records"
--- @include "due"
require_stream_role('stream.publish', nil, SHARD_KEYS_PUBLISH, true)
local P0 = 8  -- ARGV index of the first payload
local count = #ARGV - P0 + 1
if count < 1 or count > 10000 then fail('INVALID', 'a publish carries 1 to 10000 payloads') end
local key, pid, seq_s, idle_s = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local deliver_s, expires_s, headers = ARGV[5], ARGV[6], ARGV[7]
local extended = deliver_s ~= '' or expires_s ~= '' or headers ~= ''
local deliver_kind, deliver_ms, expires_ms, due_key = nil, nil, nil, false
if extended then
  local max_ms = 31622400000
  if deliver_s ~= '' then
    local kind, v = s_match(deliver_s, '^([+@])(%d+)$')
    if not kind or #v > 15 then
      fail('INVALID', "deliver must be '+MS' or '@MS', got " .. s_sub(deliver_s, 1, 40))
    end
    deliver_kind, deliver_ms = kind, tonumber(v)
    if kind == '+' and deliver_ms > max_ms then
      fail('INVALID', 'delay is at most 366 days (31622400000 ms), got ' .. v .. ' ms')
    end
    if #KEYS < 4 then fail('INVALID', 'a publish with a delivery time takes the shard\'s due index as KEYS[4]') end
  end
  if #KEYS > 3 then
    local base = stream_shape().base
    if #KEYS > 4 or KEYS[4] ~= base .. 'due' then
      fail('INVALID', 'KEYS[4] is ' .. tostring(KEYS[4]) .. ', not ' .. base .. 'due')
    end
    due_key = KEYS[4]
    expect_type(due_key, 'zset')
  end
  if expires_s ~= '' then expires_ms = int_arg(expires_s, 'expires_in ms', 1, max_ms) end
  if headers ~= '' then check_headers(headers) end
elseif #KEYS > 3 then
  fail('INVALID', 'this script takes 3 keys (meta, log, conf) without a delivery time, got ' .. #KEYS)
end
if #key > 1024 then fail('INVALID', 'a record key is at most 1024 bytes, got ' .. fmt(#key)) end
local seq = int_arg(seq_s, 'sequence', 0, 2 ^ 52)
-- the same few idle times come every call: checked once (and stored as given)
int_arg_seen(idle_s, 'producer idle_ms', 1, 2 ^ 40)
-- Type checks ride on the first command on each key, all before the first write: the
-- meta read and the first XADD (the first write itself).
local meta, field, m = KEYS[1], nil, nil
if pid == '' then
  m = typed_call('hash', 'HMGET', meta, 'tail', 'first')
else
  if seq < 1 then fail('INVALID', 'sequence must be >= 1') end
  field = producer_field(pid)
  m = typed_call('hash', 'HMGET', meta, 'tail', 'first', field)
end
local max_payload = setting_num(typed_call('hash', 'HGET', KEYS[3], 'max_payload'))
if not max_payload then fail('NOT_FOUND', 'stream (or shard) does not exist') end
local tail_s = m[1]
-- a tail that is not a plain decimal (written by hand): the log's
if not tail_s or not s_match(tail_s, '^%d+$') then tail_s = fmt(log_tail(KEYS[2])) end
for i = P0, #ARGV do
  if #ARGV[i] > max_payload then
    local which = #ARGV > P0 and 'payload ' .. fmt(i - P0) or 'the payload'
    fail('INVALID', which .. ' is ' .. fmt(#ARGV[i]) .. ' bytes; this stream accepts at most ' .. fmt(max_payload))
  end
end
local state = field and m[3]
if state then
  -- state: 'SEQ FIRST COUNT MS IDLE MAC'. The next sequence, the usual case, needs only
  -- SEQ (cut out with a plain find): it appends whatever the state says. A re-send or a
  -- refusal is answered from the state only when its MAC is this producer's; any other
  -- state (written by hand) counts as none.
  local j = s_find(state, ' ', 1, true)
  local last = j and tonumber(s_sub(state, 1, j - 1))
  if last and seq ~= last + 1 then
    local five, first, n, ms, mac = s_match(state, '^(%d+ (%d+) (%d+) (%d+) %d+) (%x+)$')
    if not five or producer_mac(pid, five) ~= mac then
      state = nil
    else
      if seq == last then
        if tonumber(n) ~= count then
          fail('SEQUENCE', 'sequence ' .. fmt(seq) .. ' was sent before with ' .. n .. ' records, now '
            .. fmt(count))
        end
        return {tonumber(first), count, ms, 1, m[2]}
      elseif seq < last then
        fail('SEQUENCE', 'sequence ' .. fmt(seq) .. ' is older than the last one (' .. fmt(last) .. ')')
      end
      fail('SEQUENCE', 'sequence gap: got ' .. fmt(seq) .. ', expected ' .. fmt(last + 1))
    end
  end
end
-- Entry IDs and the producer state are made of the strings Redis handed over (the tail
-- as HMGET read it, the time as TIME gave it): only the new tail is formatted.
local ms = now_ms_text()
-- A producer new to this shard (or pruned) takes one pruning step over the producer
-- fields, from the cursor the last step left: the states past their MS + IDLE are found
-- here, before the first write (a cursor this script did not write starts over).
local expired, cursor
if field and not state then
  local now = tonumber(ms)
  cursor = redis.call('HGET', meta, 'producer_scan')
  if not cursor or #cursor > 19 or not s_match(cursor, '^%d+$') then cursor = '0' end
  local scan = redis.call('HSCAN', meta, cursor, 'MATCH', 'producer:*', 'COUNT', 64)
  local found = scan[2]
  cursor, expired = scan[1], {}
  for i = 2, #found, 2 do
    local at, idle = s_match(found[i], '^%d+ %d+ %d+ (%d+) (%d+) %x+$')
    if at and tonumber(at) + tonumber(idle) <= now then expired[#expired + 1] = found[i - 1] end
  end
end
local log, p, k = KEYS[2], 'p', 'k'
if extended then
  -- a record with a delivery time, expiry or headers: its fields after p (and k)
  local now = tonumber(ms)
  local due = false
  if deliver_kind == '+' then
    if deliver_ms > 0 then due = now + deliver_ms end
  elseif deliver_kind == '@' then
    if deliver_ms > now + 31622400000 then
      fail('INVALID', 'deliver_at is at most 366 days ahead, got ' .. fmt(deliver_ms - now) .. ' ms ahead')
    end
    if deliver_ms > now then due = deliver_ms end
  end
  local extra = {}
  if key ~= '' then extra[#extra + 1] = k; extra[#extra + 1] = key end
  if headers ~= '' then extra[#extra + 1] = 'h'; extra[#extra + 1] = headers end
  local due_s = due and fmt(due)
  if due then extra[#extra + 1] = 'd'; extra[#extra + 1] = fmt(due - now) end
  if expires_ms then extra[#extra + 1] = 'x'; extra[#extra + 1] = fmt(now + expires_ms) end
  local dmax = due and tonumber(redis.call('HGET', meta, 'dmax'))
  -- the due index's chunk this publish appends to, read (and checked) before any write
  local dtop = due and due_top(due_key, due_bucket(due))
  local first_off = tail_s
  local added = redis.pcall('XADD', log, tail_s .. '-' .. ms, p, ARGV[P0], unpack(extra))
  if type(added) == 'table' and added.err then
    local text = tostring(added.err)
    if s_find(text, 'WRONGTYPE', 1, true) then expect_type(log, 'stream') end
    if not s_find(text, 'equal or smaller', 1, true) then error(added, 0) end
    tail_s = fmt(log_tail(log))
    redis.call('XADD', log, tail_s .. '-' .. ms, p, ARGV[P0], unpack(extra))
  end
  local tail = tonumber(tail_s)
  for i = P0 + 1, #ARGV do
    redis.call('XADD', log, fmt(tail + i - P0) .. '-' .. ms, p, ARGV[i], unpack(extra))
  end
  local last_s = fmt(tail + count - 1)
  local fields = {'tail', fmt(tail + count), 'tlast', last_s}
  if due then
    due_add(due_key, due, tail, count, dtop)
    if not dmax or due > dmax then fields[#fields + 1] = 'dmax'; fields[#fields + 1] = due_s end
  end
  if field then
    local five = seq_s .. ' ' .. tail_s .. ' ' .. fmt(count) .. ' ' .. ms .. ' ' .. idle_s
    fields[#fields + 1] = field
    fields[#fields + 1] = five .. ' ' .. producer_mac(pid, five)
    if not state then
      for i = 1, #expired, 1000 do
        redis.call('HDEL', meta, unpack(expired, i, math.min(i + 999, #expired)))
      end
      fields[#fields + 1] = 'producer_scan'
      fields[#fields + 1] = cursor
    end
  end
  redis.call('HSET', meta, unpack(fields))
  return {tail, count, ms, 0, m[2]}
end
-- the first XADD is the first write: it doubles as the log's type check, and as the
-- check that the tail is above the log's last entry (XADD refuses an ID not above it)
local added
if key ~= '' then
  added = redis.pcall('XADD', log, tail_s .. '-' .. ms, p, ARGV[P0], k, key)
else
  added = redis.pcall('XADD', log, tail_s .. '-' .. ms, p, ARGV[P0])
end
if type(added) == 'table' and added.err then
  local text = tostring(added.err)
  if s_find(text, 'WRONGTYPE', 1, true) then expect_type(log, 'stream') end
  if not s_find(text, 'equal or smaller', 1, true) then error(added, 0) end
  -- a tail below the log's (written by hand): the log's own, then the same XADD
  tail_s = fmt(log_tail(log))
  if key ~= '' then
    redis.call('XADD', log, tail_s .. '-' .. ms, p, ARGV[P0], k, key)
  else
    redis.call('XADD', log, tail_s .. '-' .. ms, p, ARGV[P0])
  end
end
local tail, count_s = tonumber(tail_s), '1'
if count > 1 then
  count_s = fmt(count)
  for i = P0 + 1, #ARGV do
    local id = fmt(tail + i - P0) .. '-' .. ms
    if key ~= '' then
      redis.call('XADD', log, id, p, ARGV[i], k, key)
    else
      redis.call('XADD', log, id, p, ARGV[i])
    end
  end
end
local new_tail = fmt(tail + count)
if not field then
  redis.call('HSET', meta, 'tail', new_tail)
  return {tail, count, ms, 0, m[2]}
end
local five = seq_s .. ' ' .. tail_s .. ' ' .. count_s .. ' ' .. ms .. ' ' .. idle_s
local new_state = five .. ' ' .. producer_mac(pid, five)
if state then
  redis.call('HSET', meta, 'tail', new_tail, field, new_state)
else
  for i = 1, #expired, 1000 do
    redis.call('HDEL', meta, unpack(expired, i, math.min(i + 999, #expired)))
  end
  redis.call('HSET', meta, 'tail', new_tail, field, new_state, 'producer_scan', cursor)
end
return {tail, count, ms, 0, m[2]}
