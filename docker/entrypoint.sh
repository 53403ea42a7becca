#!/bin/sh
# Container entry point, run under tini (PID 1) so SIGTERM from `docker stop` or Kubernetes reaches the
# server, which then drains in-flight requests for --drain-timeout seconds and exits 0.
#
#   IMAGE [SERVE FLAGS...]     -> moe-offload serve --host $HOST --port $PORT [SERVE FLAGS...]
#   IMAGE SUBCOMMAND [ARGS...] -> moe-offload SUBCOMMAND [ARGS...]   (generate, eval, trace, simulate, ...)
#
# HOST and PORT are environment variables rather than baked-in flags because the HEALTHCHECK has to probe
# the same port the server listens on, and a shell is the only place both can read it.
set -eu
case "${1:-}" in
  ""|-*) exec moe-offload serve --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" "$@" ;;
  *) exec moe-offload "$@" ;;
esac
