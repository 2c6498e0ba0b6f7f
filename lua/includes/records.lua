-- records: the fields of a log entry beyond payload and key. A record published with
-- headers, a delivery time or an expiry carries them as fields of its entry (after p,
-- and k when it has a key): h (headers, a JSON object of strings), d (the delay: the due
-- time less the publish time, the entry ID's second part, in ms; a delay fits in 5 bytes
-- of the stream's listpack where a due time since the epoch takes 10) and x (expiry, ms
-- since the epoch, server clock). Plain records have none.

-- Checks a headers argument (ARGV of publish): a JSON object of 1..64 string values,
-- names of 1..128 characters [A-Za-z0-9._-], names and values 16384 bytes in all.
-- Where the backend has no cjson (none of Redis 7 or Valkey lacks it) only the outer
-- shape and size are checked.
local function check_headers(json)
  -- 16384 bytes of names and values take at most 6 times that as JSON (\u00XX escapes),
  -- and a few bytes of quotes, colons and commas per header
  if #json > 6 * 16384 + 64 * 8 or s_sub(json, 1, 1) ~= '{' or s_sub(json, -1) ~= '}' then
    fail('INVALID', 'headers must be a JSON object of at most 16384 bytes of names and values')
  end
  if not cjson then return end
  local ok, h = pcall(cjson.decode, json)
  if not ok or type(h) ~= 'table' then fail('INVALID', 'headers are not a JSON object') end
  local n, size = 0, 0
  for name, value in pairs(h) do
    if type(name) ~= 'string' or #name < 1 or #name > 128 or not s_match(name, '^[A-Za-z0-9._-]+$') then
      fail('INVALID', 'header name ' .. s_sub(tostring(name), 1, 40) .. ' is not 1..128 characters of A-Za-z0-9._-')
    end
    if type(value) ~= 'string' then fail('INVALID', 'header ' .. name .. ' is not a string') end
    n, size = n + 1, size + #name + #value
  end
  if n == 0 then fail('INVALID', "headers are an empty object: send '' for none") end
  if n > 64 then fail('INVALID', 'at most 64 headers, got ' .. fmt(n)) end
  if size > 16384 then fail('INVALID', 'headers are at most 16384 bytes of names and values, got ' .. fmt(size)) end
end

-- True when a log entry's fields are a plain record's: p, then at most k.
local function plain_fields(fields)
  return fields[1] == 'p' and (fields[3] == nil or (fields[3] == 'k' and fields[5] == nil))
end

-- An expiry time as a publish wrote it (a plain decimal), or false: any other value (an
-- entry written by hand) counts as absent.
local function time_field(v)
  if v and #v <= 15 and s_match(v, '^%d+$') then return v end
  return false
end

-- The due time (ms since the epoch, a number) of the log entry with ID id whose d field
-- is v (its delay, ms after the publish time the ID carries), or false when v is not a
-- plain decimal (an entry written by hand: no delay). A d of 13 digits or more is a due
-- time itself, as clients before the delay was stored wrote it (a delay is at most 366
-- days: 11 digits), so records they published are held as before.
local function due_time(id, v)
  if not (v and #v <= 15 and s_match(v, '^%d+$')) then return false end
  if #v >= 13 then return tonumber(v) end
  local ms = s_match(id, '%-(%d+)$')
  if not ms or #ms > 15 then return false end
  return tonumber(ms) + tonumber(v)
end

-- payload, key (false: none), headers, due time, expiry (strings; false when absent or,
-- for the times, not a plain decimal) of the fields of the log entry with ID id.
local function record_fields(fields, id)
  local payload, key, h, d, x = '', false, false, false, false
  for i = 1, #fields, 2 do
    local f = fields[i]
    if f == 'p' then payload = fields[i + 1]
    elseif f == 'k' then key = fields[i + 1]
    elseif f == 'h' then h = fields[i + 1]
    elseif f == 'd' then
      d = due_time(id, fields[i + 1])
      d = d and fmt(d)
    elseif f == 'x' then x = time_field(fields[i + 1])
    end
  end
  return payload, key, h, d, x
end

-- What a reply carries in a record's key place: the key (false: none) for a plain
-- record, else {key, headers, due, expiry} (false for each one absent).
local function key_slot(key, h, d, x)
  if h or d or x then return {key, h, d, x} end
  return key
end

-- True when a log entry's fields carry an expiry at or before now (ms).
local function expired_at(fields, now)
  for i = 1, #fields, 2 do
    if fields[i] == 'x' then
      local x = time_field(fields[i + 1])
      return x ~= false and tonumber(x) <= now
    end
  end
  return false
end
