#!/bin/sh
# Cassandra for the compose stack with password authentication and grants on. The official image
# has no setting for them, so this script (the container's entrypoint) switches the image's
# cassandra.yaml to PasswordAuthenticator and CassandraAuthorizer, runs the image's own
# entrypoint, and once CQL answers changes the superuser's well-known first password
# ("cassandra") to TANDEM_CASSANDRA_PASSWORD (the admin's: only store-migrate logs in with it). After a
# restart the data volume already holds the new password and the change is skipped. CQL is TLS
# only (below).
set -eu

: "${TANDEM_CASSANDRA_PASSWORD:?the superuser password; tandem secrets DIR writes one}"
case "$TANDEM_CASSANDRA_PASSWORD" in
    *"'"*) echo "entrypoint: TANDEM_CASSANDRA_PASSWORD must not contain a single quote" >&2; exit 2 ;;
esac
setup_deadline_s=${TANDEM_CASSANDRA_SETUP_DEADLINE_S:-600}

config="${CASSANDRA_CONF:-/etc/cassandra}/cassandra.yaml"  # the image sets CASSANDRA_CONF
# Both spellings (authenticator: X and authenticator: {class_name: ...X}) name the class.
sed -i -E '/^[[:space:]]*#/!s/AllowAllAuthenticator/PasswordAuthenticator/' "$config"
if ! grep -Eq '^[^#]*PasswordAuthenticator' "$config"; then
    echo "entrypoint: no authenticator setting found in $config" >&2
    exit 1
fi
# Grants count: the services' role may read and write its keyspace and nothing else
# (`tandem store migrate` grants it); with AllowAllAuthorizer every login may do everything.
sed -i -E '/^[[:space:]]*#/!s/AllowAllAuthorizer/CassandraAuthorizer/' "$config"
if ! grep -Eq '^[^#]*CassandraAuthorizer' "$config"; then
    echo "entrypoint: no authorizer setting found in $config" >&2
    exit 1
fi

# Acknowledged writes are durable: batch mode syncs the commit log before a write is acknowledged
# (the image's periodic mode acknowledges first and syncs every 10 s, so a killed node loses up to
# 10 s of acknowledged turns). Batch mode refuses to start while commitlog_sync_period is set.
sed -i -E 's/^commitlog_sync:.*/commitlog_sync: batch/; s/^(commitlog_sync_period(_in_ms)?:)/# \1/' "$config"
if ! grep -Eq '^commitlog_sync: batch' "$config"; then
    echo "entrypoint: no commitlog_sync setting found in $config" >&2
    exit 1
fi

# CQL takes TLS clients only (optional: false), with the `cassandra` certificate of the tls volume
# (tandem secrets DIR; the certs service writes its key and certificate as one PEM keystore the
# cassandra user may read). The image's client_encryption_options block (up to the next top-level
# key) is replaced by this one. cqlsh below and in the healthcheck checks the node against the CA
# (SSL_CERTFILE, SSL_VALIDATE: the service's environment).
keystore=${TANDEM_CASSANDRA_KEYSTORE:-/etc/tandem/tls/cassandra-keystore.pem}
truststore=${SSL_CERTFILE:-/etc/tandem/tls/ca.pem}
edited=$(awk '/^client_encryption_options:/ {skip = 1; next} skip && /^[^[:space:]#]/ {skip = 0} !skip' "$config")
printf '%s\n%s\n' "$edited" "client_encryption_options:
  enabled: true
  optional: false
  ssl_context_factory:
    class_name: org.apache.cassandra.security.PEMBasedSslContextFactory
  keystore: $keystore
  truststore: $truststore" > "$config"
if [ "$(grep -c '^client_encryption_options:' "$config")" != 1 ]; then
    echo "entrypoint: client_encryption_options not set once in $config" >&2
    exit 1
fi

docker-entrypoint.sh cassandra -f &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' TERM INT

can_log_in() {
    cqlsh --ssl -u cassandra -p "$1" -e 'SELECT release_version FROM system.local' >/dev/null 2>&1
}

started=$(date +%s)
until can_log_in "$TANDEM_CASSANDRA_PASSWORD"; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "entrypoint: cassandra exited before its password was set" >&2
        wait "$pid" || exit $?
        exit 1
    fi
    if [ $(($(date +%s) - started)) -gt "$setup_deadline_s" ]; then
        echo "entrypoint: could not set the superuser password within ${setup_deadline_s}s" >&2
        kill -TERM "$pid"
        wait "$pid" || true
        exit 1
    fi
    # The default superuser appears some seconds after CQL opens; until then this fails.
    if can_log_in cassandra; then
        cqlsh --ssl -u cassandra -p cassandra -e "ALTER ROLE cassandra WITH PASSWORD = '$TANDEM_CASSANDRA_PASSWORD'" >/dev/null 2>&1 || true
    else
        sleep 5
    fi
done
echo "entrypoint: password authentication and client TLS are on"

status=0
wait "$pid" || status=$?
while kill -0 "$pid" 2>/dev/null; do  # a signal interrupts wait; cassandra is still stopping
    wait "$pid" || status=$?
done
exit "$status"
