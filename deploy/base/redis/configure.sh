#!/bin/sh
# Writes this pod's redis.conf and sentinel.conf into $CONF (an emptyDir: sentinel rewrites its file).
# The master is whoever the sentinels name now (after a failover, not redis-0); when no sentinel answers
# (the first start, or every pod restarted at once), redis-0. Addresses are the pods' stable DNS names
# (headless Service redis-headless). The variables have the cluster's values by default; tests/
# test_deploy_redis.py sets them to run this script against real redis-server processes on one machine.
set -eu
: "${SERVICE:=redis-headless}"
: "${MASTER_SET:=kvgate}"
: "${ME:=$(hostname).$SERVICE}"
: "${REDIS_PORT:=6379}"
: "${SENTINEL_PORT:=26379}"
: "${SENTINELS:=redis-0.$SERVICE:26379 redis-1.$SERVICE:26379 redis-2.$SERVICE:26379}"
: "${FIRST_MASTER:=redis-0.$SERVICE:6379}"
: "${DOWN_AFTER_MS:=5000}"
: "${FAILOVER_TIMEOUT_MS:=60000}"
: "${CONF:=/conf}"
: "${DATA:=/data}"
: "${SENTINEL_DIR:=/tmp}"

MASTER=""
for sentinel in $SENTINELS; do
  MASTER="$(timeout 3 redis-cli -h "${sentinel%:*}" -p "${sentinel##*:}" --raw \
    sentinel get-master-addr-by-name "$MASTER_SET" 2>/dev/null | paste -sd : - || true)"
  case "$MASTER" in
    ?*:?*) break ;;
    *) MASTER="" ;;
  esac
done
[ -n "$MASTER" ] || MASTER="$FIRST_MASTER"
MASTER_HOST="${MASTER%:*}"
MASTER_PORT="${MASTER##*:}"

{
  echo "port $REDIS_PORT"
  echo "dir $DATA"
  echo "appendonly yes"
  echo "protected-mode no"
  echo "replica-announce-ip $ME"
  [ "$MASTER" = "$ME:$REDIS_PORT" ] || echo "replicaof $MASTER_HOST $MASTER_PORT"
} > "$CONF/redis.conf"
cat > "$CONF/sentinel.conf" <<CONF
port $SENTINEL_PORT
dir $SENTINEL_DIR
protected-mode no
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $ME
sentinel monitor $MASTER_SET $MASTER_HOST $MASTER_PORT 2
sentinel down-after-milliseconds $MASTER_SET $DOWN_AFTER_MS
sentinel failover-timeout $MASTER_SET $FAILOVER_TIMEOUT_MS
sentinel parallel-syncs $MASTER_SET 1
CONF
echo "configured $ME:$REDIS_PORT, master $MASTER"
