#!/usr/bin/env bash
# Open MPI's launch agent for the namespace hosts (plm_rsh_agent): called as
# "rsh_agent.sh [ssh-style options] HOST COMMAND...", it runs COMMAND inside HOST's namespace,
# as ssh would run it on that host.
while [[ ${1:-} == -* ]]; do shift; done
host=$1
shift
exec ip netns exec "$host" /bin/sh -c "$*"
