-- producer: the meta-hash field of an idempotent producer's state (lua/publish.lua).

-- 'producer:ID' by id, the id checked once (a decimal integer of at most 20 digits): the
-- same few ids come every call, and functions keep this table between calls (bounded).
local PRODUCER_FIELDS, producer_fields = {}, 0
local function producer_field(pid)
  local field = PRODUCER_FIELDS[pid]
  if field then return field end
  if #pid > 20 or not s_match(pid, '^%d+$') then
    fail('INVALID', 'producer id must be a decimal integer, got ' .. s_sub(pid, 1, 40))
  end
  if producer_fields >= 1024 then PRODUCER_FIELDS, producer_fields = {}, 0 end
  field = 'producer:' .. pid
  PRODUCER_FIELDS[pid], producer_fields = field, producer_fields + 1
  return field
end
