# Sourced by the mariadb image's entrypoint when it initialises an empty data
# directory (docker-compose.yml mounts this directory as /docker-entrypoint-initdb.d):
# the `exporter` user mysqld_exporter connects as. It may read server status and
# process lists and nothing of the sale's data; at most 3 connections.
# On a data volume made before this file existed, run the same statements once as
# root (docs/operations.md, "Prometheus and Grafana files").
if [ -z "${MYSQLD_EXPORTER_PASSWORD:-}" ]; then
  echo "10-exporter-user.sh: MYSQLD_EXPORTER_PASSWORD is not set" >&2
  exit 1
fi
docker_process_sql --database=mysql <<SQL
CREATE USER IF NOT EXISTS 'exporter'@'%' IDENTIFIED BY '${MYSQLD_EXPORTER_PASSWORD}' WITH MAX_USER_CONNECTIONS 3;
GRANT PROCESS, REPLICA MONITOR ON *.* TO 'exporter'@'%';
GRANT SELECT ON performance_schema.* TO 'exporter'@'%';
SQL
