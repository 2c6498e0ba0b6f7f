-- roles: the Redis type of each key of a group on one shard, in the order of
-- felix_redis.keys.GROUP_ROLES (which scripts receive them in).

local GROUP_ROLE_TYPES = {
  {'group', 'hash'}, {'lease', 'zset'}, {'owed', 'zset'}, {'attempts', 'hash'}, {'done', 'zset'},
  {'redo', 'zset'}, {'dead', 'hash'}, {'owner', 'hash'}, {'byowner', 'zset'}, {'wake', 'stream'},
  {'held', 'zset'},
}
