#!/usr/bin/env bash
# compose/.env for docker compose: the Redis password every service uses, generated once
# (32 hex characters, URL-safe in redis://:PASSWORD@host:port/0). Never committed (.gitignore).
#
#   compose/setup.sh                    # writes compose/.env if it is absent
set -euo pipefail
env_file=$(cd "$(dirname "$0")" && pwd)/.env
if [ -f "$env_file" ] && grep -q '^KAIROS_REDIS_PASSWORD=.' "$env_file"; then
  echo "$env_file: present"
  exit 0
fi
umask 077
echo "KAIROS_REDIS_PASSWORD=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" >> "$env_file"
echo "$env_file: written"
