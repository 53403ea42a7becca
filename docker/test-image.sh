#!/usr/bin/env bash
# Build the CPU image and check it as an operator would: /health, a chat completion and /metrics on
# 127.0.0.1, non-root, then `docker stop` during a streamed request: the request must finish (drain) and the
# container must exit 0 within the drain timeout.  Prints the image size and the time from start to healthy.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: docker/test-image.sh [--setup] [--base IMAGE] [--tag TAG] [--name NAME] [--port N] [--drain-timeout S]
                            [--keep] [--dry-run]

Builds docker/Dockerfile.cpu from the repository root and tests the image.

  --setup            first install what this needs on a bare Debian machine (docker.io, debootstrap) with
                     apt-get, start dockerd in the background if no daemon answers, and make the local base
                     image (see --base) if it does not exist yet
  --base IMAGE       base image for both stages (default: local/debian:bookworm; made with --setup by
                     `debootstrap --variant=minbase bookworm` + `docker import`, for machines that cannot pull
                     from a registry).  Use --base debian:bookworm-slim where registries are reachable
  --tag TAG          image tag (default moe-offload:cpu)
  --name NAME        container name (default moe-offload; the script refuses to touch an existing one)
  --port N           port the container serves on (default 18080; the container uses host networking)
  --drain-timeout S  the server's --drain-timeout (default 30, the server's own default); Docker's
                     --stop-timeout is 15 s more
  --keep             leave the container running after the checks instead of stopping it
  --dry-run          print the docker build/run/stop commands this would run, and exit (docs/operations.md's
                     "Run in Docker" commands are checked against these by tests/test_docker_files.py)
  -h, --help         this text

Why it is built this way:
  * Host networking only (`--network host`): the checks talk to 127.0.0.1, never to a container bridge
    address.  The build also runs with --network host so apt and pip inside it reach the same mirrors.
  * The CPU torch wheel: if this machine's pip has torch's CPU build on local disk (a find-links folder), the
    wheel is copied into docker/wheels/ (part of the build context; pip inside the build finds it there) and
    no torch index is used; otherwise the build fetches it from torch's CPU index.
  * If this machine's pip trusts an extra certificate bundle (an intercepting proxy or a private mirror),
    the bundle is copied into docker/certs/ so pip inside the build stage trusts it too; the final image
    never contains it.
  * The image's apt sources and pip index can be replaced with APT_MIRROR / PIP_INDEX_URL environment
    variables here, passed through as build arguments.
EOF
}

BASE=local/debian:bookworm
TAG=moe-offload:cpu
PORT=18080
NAME=moe-offload
DRAIN=30
SETUP=0
KEEP=0
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --setup) SETUP=1 ;;
    --base) BASE="$2"; shift ;;
    --tag) TAG="$2"; shift ;;
    --name) NAME="$2"; shift ;;
    --dry-run) DRY=1 ;;
    --port) PORT="$2"; shift ;;
    --drain-timeout) DRAIN="$2"; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "$0")/.."
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile.cpu)
STOP_TIMEOUT=$((DRAIN + 15))  # Docker's SIGKILL comes this long after SIGTERM: after the drain, not during it
say() { printf '== %s\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }

# The torch wheel: from the local find-links folder(s) of this machine's pip, if it has one there.
torch_wheel=""
find_links=$(python3 -m pip config get global.find-links 2>/dev/null || true)
for dir in ${PIP_FIND_LINKS:-$find_links}; do
  for whl in "$dir"/torch-"$TORCH_VERSION"+cpu-*.whl; do [ -f "$whl" ] && torch_wheel="$whl"; done
done
pip_cert=$(python3 -m pip config get global.cert 2>/dev/null || true)
pip_cert="${PIP_CERT:-$pip_cert}"

# The commands under test, built once: --dry-run prints exactly these.
BUILD=(docker build --network host -f docker/Dockerfile.cpu -t "$TAG" --build-arg BASE_IMAGE="$BASE")
[ -n "${APT_MIRROR:-}" ] && BUILD+=(--build-arg APT_MIRROR="$APT_MIRROR")
[ -n "${PIP_INDEX_URL:-}" ] && BUILD+=(--build-arg PIP_INDEX_URL="$PIP_INDEX_URL")
[ -n "$torch_wheel" ] && BUILD+=(--build-arg TORCH_INDEX_URL=)  # the wheel in docker/wheels/ is enough
BUILD+=(.)
RUN=(docker run -d --name "$NAME" --network host -e PORT="$PORT" --stop-timeout "$STOP_TIMEOUT" "$TAG" --drain-timeout "$DRAIN")
STOP=(docker stop "$NAME")
if [ "$DRY" = 1 ]; then
  printf '%s\n' "${BUILD[*]}" "${RUN[*]}" "${STOP[*]}"
  exit 0
fi

fail() { printf 'FAIL: %s\n' "$*" >&2; docker logs --tail 40 "$NAME" >&2 2>&1 || true; exit 1; }
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$2"; }

if [ "$SETUP" = 1 ]; then
  command -v dockerd > /dev/null && command -v debootstrap > /dev/null \
    || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap; }
  if ! docker info > /dev/null 2>&1; then
    say "starting dockerd (log: ${TMPDIR:-/tmp}/dockerd.log)"
    nohup dockerd > "${TMPDIR:-/tmp}/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
  fi
  if ! docker image inspect "$BASE" > /dev/null 2>&1; then
    say "making the base image $BASE with debootstrap (a few minutes)"
    rootfs=$(mktemp -d)
    run debootstrap --variant=minbase bookworm "$rootfs"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*  # cached .debs: 30+ MB of nothing
    tar -C "$rootfs" -c . | docker import - "$BASE"
    rm -rf "$rootfs"
  fi
fi
docker info > /dev/null 2>&1 || { echo "no Docker daemon answers; run with --setup, or start dockerd" >&2; exit 1; }
if docker container inspect "$NAME" > /dev/null 2>&1; then
  echo "a container named $NAME exists already; remove it or pass --name" >&2
  exit 1
fi

rm -f docker/wheels/*.whl docker/certs/*.crt
trap 'rm -f docker/wheels/*.whl docker/certs/*.crt' EXIT
if [ -n "$torch_wheel" ]; then
  say "torch wheel from local disk: $(basename "$torch_wheel")"
  cp "$torch_wheel" docker/wheels/
fi
if [ -n "$pip_cert" ] && [ -f "$pip_cert" ]; then
  say "pip trusts $pip_cert here: the build stage will trust it too"
  cp "$pip_cert" docker/certs/build-ca.crt
fi

say "build"
t0=$(now)
run "${BUILD[@]}"
t1=$(now)
size=$(docker image inspect -f '{{.Size}}' "$TAG")
say "built in $(elapsed "$t0" "$t1") s; image size $((size / 1000000)) MB"

say "run"
trap 'rm -f docker/wheels/*.whl docker/certs/*.crt; [ "$KEEP" = 1 ] || docker rm -f "$NAME" > /dev/null 2>&1 || true' EXIT
t_run=$(now)
# --stop-timeout: give the drain its time before Docker's SIGKILL (Docker's default is 10 s).
run "${RUN[@]}"
url="http://127.0.0.1:$PORT"
t_health=""
for _ in $(seq 600); do
  state=$(docker inspect -f '{{.State.Status}}' "$NAME")
  [ "$state" = running ] || fail "container is $state"
  if [ -z "$t_health" ] && curl -fsS "$url/health" > /dev/null 2>&1; then t_health=$(now); fi
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ] && break
  sleep 0.5
done
t_healthy=$(now)
[ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ] || fail "not healthy after 300 s"
say "/health answered 200 after $(elapsed "$t_run" "$t_health") s; Docker reported healthy after $(elapsed "$t_run" "$t_healthy") s (health checks run every 5 s)"

uid=$(docker exec "$NAME" id -u)
[ "$uid" != 0 ] || fail "the server runs as root"
say "runs as uid $uid"

say "chat completion"
reply=$(curl -fsS "$url/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "target", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16, "temperature": 0}')
python3 - "$reply" <<'EOF' || fail "bad chat completion: $reply"
import json, sys
r = json.loads(sys.argv[1])
text = r["choices"][0]["message"]["content"]
assert text and r["usage"]["completion_tokens"] > 0, r
print("   ", repr(text[:60]), r["usage"])
EOF

say "/metrics"
metrics=$(curl -fsS "$url/metrics")
echo "$metrics" | grep -Eq '^moe_offload_generation_tokens_total [1-9]' || fail "generation_tokens_total not counted"
echo "$metrics" | grep -Eq '^moe_offload_expert_cache_hits_total\{layer="0"\}' || fail "no per-layer expert counters"
say "metrics counted the request"

if [ "$KEEP" = 1 ]; then say "left running as $NAME on $url"; exit 0; fi

say "docker stop during a streamed request (drain timeout $DRAIN s)"
stream=$(mktemp)
curl -fsSN "$url/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "target", "prompt": "To be, or not to be", "max_tokens": 400, "min_tokens": 400, "temperature": 0, "stream": true}' \
  > "$stream" &
curl_pid=$!
for _ in $(seq 100); do grep -q '^data: {' "$stream" && break; sleep 0.1; done
grep -q '^data: {' "$stream" || fail "the stream did not start"
t0=$(now)
run "${STOP[@]}" > /dev/null
t1=$(now)
wait "$curl_pid" || fail "the streamed request failed during the drain"
code=$(docker inspect -f '{{.State.ExitCode}}' "$NAME")
stop_s=$(elapsed "$t0" "$t1")
[ "$code" = 0 ] || fail "exit code $code after docker stop"
python3 -c "import sys; sys.exit(float(sys.argv[1]) > float(sys.argv[2]))" "$stop_s" "$DRAIN" || fail "stop took $stop_s s > $DRAIN s"
grep -Eq '"finish_reason": ?"length"' "$stream" || fail "the in-flight stream was cut instead of drained: $(tail -c 300 "$stream")"
tail -n 2 "$stream" | grep -q '^data: \[DONE\]' || fail "the stream did not end with [DONE]"
say "stopped in $stop_s s with exit code 0; the in-flight stream finished ($(grep -c '^data: {' "$stream") chunks)"
rm -f "$stream"
say "PASS: image $TAG, $((size / 1000000)) MB, healthy $(elapsed "$t_run" "$t_healthy") s after docker run"
